#!/usr/bin/env bash
# Stop the processes that start_local.sh / start_supernode.sh started (by their PID
# files in $RUN_DIR/pids), with their children (executor or SuperExec, ServerApp,
# ClientApp).
#
# Usage: deploy/stop_local.sh [NAME...]   (NAME: superlink, supernode-node-0, ...;
#                                          default: all)
# SIGTERM first, SIGKILL for whatever still runs after STOP_TIMEOUT seconds (default 20).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

shopt -s nullglob
if [[ $# -gt 0 ]]; then
  files=()
  for name in "$@"; do files+=("$RUN_DIR/pids/$name.pid"); done
else
  files=("$RUN_DIR"/pids/*.pid)
fi
[[ ${#files[@]} -gt 0 ]] || { echo "nothing to stop in $RUN_DIR/pids"; exit 0; }

pids=()
for file in "${files[@]}"; do
  [[ -f "$file" ]] || { echo "no $file" >&2; continue; }
  pid="$(cat "$file")"
  # Only a Flower process: never a process that reused a stale PID.
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null \
    | grep -Eq "flower-super|flwr-gsgm-supernode|flwr_gsgm\.deploy\.supernode"; then
    # The whole tree, collected before anything dies (orphans lose their parent link).
    mapfile -t tree < <(descendants "$pid")
    pids+=("${tree[@]}")
  fi
done

if [[ ${#pids[@]} -gt 0 ]]; then
  kill -TERM "${pids[@]}" 2>/dev/null || true
  deadline=$((SECONDS + ${STOP_TIMEOUT:-20}))
  while ((SECONDS < deadline)); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [[ ${#alive[@]} -eq 0 ]] && break
    sleep 0.5
  done
  alive=()
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
  if [[ ${#alive[@]} -gt 0 ]]; then
    echo "SIGKILL to ${alive[*]} (still running after ${STOP_TIMEOUT:-20} s)"
    kill -KILL "${alive[@]}" 2>/dev/null || true
  fi
fi
rm -f "${files[@]}"
echo "stopped ${#pids[@]} process(es)"
