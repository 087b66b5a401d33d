#!/usr/bin/env bash
# Run the Flower App in Flower's simulation engine with NUM_NODES SuperNodes:
#   scripts/run_simulation.sh [NUM_NODES] [key=value ...]
# key=value pairs override the run config (TOML values: strings in quotes, e.g.
# strategy='"asgd"' or strategy=\"asgd\"). Flower's state (config.toml, the local
# SuperLink, the run log) lives in $FLWR_HOME, default .flwr/ of this project. The
# local SuperLink that `flwr run` starts is stopped when the run ends, and the exit
# code is the run's (flwr run --stream exits 0 even when the ServerApp failed): 0
# completed, 3 the model diverged (outputs written; simulations/worker.py's
# DIVERGED_EXIT), 1 failed. If
# Flower's simulation runtime does not end the run END_GRACE seconds (default 120)
# after the ServerApp ended (a ClientApp that never returns), it is stopped and the
# script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_NODES=${1:-10}
shift || true
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr}"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1  # the SuperLink reads it at start
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
mkdir -p "$FLWR_HOME"
case "$(cd "$FLWR_HOME" && pwd)/" in
  "$PWD"/*)
    # Flower packs every file of the project that git does not ignore into the app bundle.
    if ! git check-ignore -q "$FLWR_HOME" 2>/dev/null; then
      echo "warning: FLWR_HOME=$FLWR_HOME lies in the project and is not git-ignored;" \
           "Flower will pack it into the app bundle. Use .flwr/ or a folder outside." >&2
    fi ;;
esac
# The local SuperLink connection; the simulation itself is set with flwr run
# --federation-config below (Flower 1.42 deprecates options.* in config.toml).
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local-in-memory:"
TOML
# NUM_NODES simulated SuperNodes, one Ray worker per core (num-cpus = 1 per ClientApp).
federation="num-supernodes=$NUM_NODES client-resources-num-cpus=1 client-resources-num-gpus=0.0"
federation+=' init-args-logging-level="ERROR"'

stop_superlink() {
  # The local SuperLink is the flower-superlink whose log file lies in our FLWR_HOME.
  pkill -TERM -f "flower-superlink.*$FLWR_HOME/local-superlink" 2>/dev/null || true
}
trap stop_superlink EXIT

descendants() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

stop_run_tree() {
  # Our local SuperLink and every process it started (the simulation runtime, its Ray
  # workers), listed before any is stopped (orphans would leave the tree).
  local link pids
  link=$(pgrep -f "flower-superlink.*$FLWR_HOME/local-superlink" 2>/dev/null || true)
  [ -n "$link" ] || return 0
  pids="$link $(for p in $link; do descendants "$p"; done)"
  kill -TERM $pids 2>/dev/null || true
  sleep 5
  for p in $pids; do  # still there (an idle Ray worker): by pid, if still one of ours
    if ps -o args= -p "$p" 2>/dev/null | grep -qE "ray|flwr|flower"; then
      kill -KILL "$p" 2>/dev/null || true
    fi
  done
}

args=(run . local --stream --federation-config "$federation")
if [ $# -gt 0 ]; then args+=(--run-config "$*"); fi
log="$FLWR_HOME/last-run.log"
: > "$log"
flwr "${args[@]}" > "$log" 2>&1 &
flwr_pid=$!
tail -n +1 -f --pid="$flwr_pid" "$log" &
tail_pid=$!
# Flower's simulation runtime ends a run only once every ClientApp call has returned:
# a ClientApp that never returns keeps `flwr run` waiting after the ServerApp ended.
# The ServerApp logs "[flwr-gsgm] run ended: <status>" last (serverapp/server_app.py);
# if `flwr run` is still there END_GRACE seconds later, stop it and fail.
END_GRACE=${END_GRACE:-120}
ended_at=""
stuck=""
while kill -0 "$flwr_pid" 2>/dev/null; do
  if [ -z "$ended_at" ] && grep -q "\[flwr-gsgm\] run ended:" "$log"; then
    ended_at=$(date +%s)
  fi
  if [ -n "$ended_at" ] && [ $(( $(date +%s) - ended_at )) -ge "$END_GRACE" ]; then
    stuck=1
    stop_run_tree
    kill -TERM "$flwr_pid" 2>/dev/null || true
    break
  fi
  sleep 1
done
wait "$flwr_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
if [ -n "$stuck" ]; then
  ended=$(grep -o "\[flwr-gsgm\] run ended: .*" "$log" | head -1)
  echo "the ServerApp ended (${ended#*run ended: }) but Flower's simulation runtime did" \
       "not end the run within END_GRACE=${END_GRACE} s: a ClientApp call that never" \
       "returns holds it (or the runtime is slow to stop); stopped the local SuperLink" \
       "and its processes. log: $log" >&2
  exit 1
fi
run_id=$(grep -o "Successfully started run [0-9]*" "$log" | grep -o "[0-9]*$" || true)
if [ -z "$run_id" ]; then
  echo "flwr run did not start a run (see above)" >&2
  exit 1
fi
status=$(flwr ls local --run-id "$run_id" --format json 2>/dev/null | grep -o '"finished:[a-z]*"' | head -1 || true)
diverged=$(grep -o "\[flwr-gsgm\] run ended: diverged: .*" "$log" | head -1 || true)
if [ -n "$diverged" ]; then
  echo "run $run_id diverged: ${diverged#*run ended: diverged: }; log: $log" >&2
  exit 3
fi
if [ "$status" != '"finished:completed"' ]; then
  echo "run $run_id ended with status ${status:-unknown}; log: $log" >&2
  exit 1
fi
echo "run $run_id completed"
