#!/usr/bin/env bash
# Start (or restart) the SuperLink of the deployment that start_local.sh set up in
# $RUN_DIR: TLS, SuperNode authentication, on the port of $RUN_DIR/state.env.
#
# Usage: deploy/start_superlink.sh
# Environment: as start_local.sh; DATABASE (from state.env, set by start_local.sh):
#   the SuperLink's state file, or empty for its in-memory state. With a database a
#   restarted SuperLink keeps its runs and the SuperNodes' registered keys, so the
#   SuperNodes reconnect by themselves (benchmarks/soak_deployment.py restarts it).
# Returns once https://ADDRESS/health answers; exits 1 with the log's tail otherwise.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ -f "$RUN_DIR/state.env" ]] || die "no $RUN_DIR/state.env: run start_local.sh first"
source "$RUN_DIR/state.env"
need flower-superlink setsid
if [[ -f "$RUN_DIR/pids/superlink.pid" ]] && kill -0 "$(cat "$RUN_DIR/pids/superlink.pid")" 2>/dev/null; then
  die "the SuperLink already runs (PID $(cat "$RUN_DIR/pids/superlink.pid"))"
fi

# Fleet, Control and Runtime APIs on one HTTPS port; SuperNodes only get in with a
# registered key (--enable-supernode-auth requires TLS).
database=()
[[ -n "${DATABASE:-}" ]] && database=(--database "$DATABASE")
log="$RUN_DIR/logs/superlink.log"
[[ -f "$log" ]] && cat "$log" >>"$RUN_DIR/logs/superlink.earlier.log"  # a restart keeps the old log
FLWR_HOME="$RUN_DIR/superlink-home" start_daemon superlink "$log" \
  flower-superlink \
  --ssl-ca-certfile "$CERT_DIR/ca.crt" \
  --ssl-certfile "$CERT_DIR/server.pem" \
  --ssl-keyfile "$CERT_DIR/server.key" \
  --enable-supernode-auth \
  "${database[@]}" \
  --host 127.0.0.1 --port "$PORT" \
  --disable-runtime-dependency-installation
wait_health "$ADDRESS" "$CERT_DIR/ca.crt" "${START_TIMEOUT:-60}" \
  || { tail -n 20 "$log" >&2; die "SuperLink did not start"; }
echo "SuperLink https://$ADDRESS (PID $(cat "$RUN_DIR/pids/superlink.pid"), log $log${DATABASE:+, database $DATABASE})"
