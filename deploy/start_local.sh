#!/usr/bin/env bash
# Start a SuperLink (TLS + SuperNode authentication) and N SuperNodes on 127.0.0.1,
# each SuperNode a separate process with its own key and
# --node-config "partition-id=i num-partitions=N".
#
# Usage: deploy/start_local.sh N
# Environment (optional): PORT (SuperLink port, default: a free one), RUN_DIR,
#   CERT_DIR, KEY_DIR, CONNECTION, FLWR_HOME, VENV, CLIENTAPP_MODE (see lib.sh: warm,
#   the default, or per-message),
#   NODE_CONFIG_EXTRA (appended to every --node-config, e.g. "device='cpu'"),
#   NODE_CONFIG_EXTRA_<i> (appended to partition i's --node-config only, after it),
#   START_TIMEOUT (seconds to wait for the SuperLink, default 60),
#   DATABASE (the SuperLink's state file, kept across its restarts: see
#   start_superlink.sh; default: in-memory state).
#
# Creates the certificates and keys if missing, then writes into $RUN_DIR:
#   state.env           PORT, ADDRESS, ... of this deployment (read by the other scripts)
#   flwr-home/          FLWR_HOME of the flwr CLI: config.toml with [superlink.$CONNECTION]
#   superlink-home/     FLWR_HOME of the SuperLink and its ServerApp processes
#   supernode-<key>/    FLWR_HOME and cache-dir of each SuperNode
#   logs/*.log, pids/*.pid, nodes/<key>.node-id
# Then: FLWR_HOME=$RUN_DIR/flwr-home flwr run . gsgm-local --run-config deploy/run-config.toml --stream
# Stop everything with deploy/stop_local.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $# -eq 1 && "$1" =~ ^[1-9][0-9]*$ ]] || die "usage: start_local.sh N (number of SuperNodes)"
num="$1"
need flwr flower-superlink flower-supernode openssl setsid

if [[ -n "$(ls "$RUN_DIR/pids/"*.pid 2>/dev/null)" ]]; then
  die "$RUN_DIR/pids holds PID files: run deploy/stop_local.sh first"
fi
mkdir -p "$RUN_DIR"/{logs,pids,nodes} "$RUN_DIR/superlink-home"
# A new SuperLink in memory knows no key an earlier deployment in this folder
# registered, so their node ids must go, or start_supernode.sh would skip registering
# and the SuperLink would refuse every SuperNode (code 305). A database is started
# anew for the same reason.
rm -f "$RUN_DIR/nodes/"*.node-id
if [[ -n "${DATABASE:-}" ]]; then
  DATABASE="$(realpath -m "$DATABASE")"  # the SuperLink runs from the repository folder
  rm -f "$DATABASE"
fi

[[ -f "$CERT_DIR/server.pem" ]] || "$DEPLOY_DIR/make_certs.sh" "$CERT_DIR"
"$DEPLOY_DIR/make_node_keys.sh" -o "$KEY_DIR" "$num" >/dev/null

port="${PORT:-$(free_port)}"
address="127.0.0.1:$port"
cat >"$RUN_DIR/state.env" <<STATE
PORT=$port
ADDRESS=$address
NUM_PARTITIONS=$num
CERT_DIR=$CERT_DIR
KEY_DIR=$KEY_DIR
CONNECTION=$CONNECTION
FLWR_HOME=$FLWR_HOME
DATABASE=${DATABASE:-}
STATE

# The flwr CLI's connection to this SuperLink (HTTPS, verified against our CA).
write_connection "$FLWR_HOME/config.toml" "$CONNECTION" "$address" "$CERT_DIR/ca.crt"

"$DEPLOY_DIR/start_superlink.sh"

for ((i = 0; i < num; i++)); do
  "$DEPLOY_DIR/start_supernode.sh" "$i" "node-$i"
done

cat <<DONE

Run GSGM on it:
  FLWR_HOME=$FLWR_HOME flwr run $REPO_DIR $CONNECTION --run-config $DEPLOY_DIR/run-config.toml --stream
Stop: $DEPLOY_DIR/stop_local.sh
DONE
