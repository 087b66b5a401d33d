#!/usr/bin/env bash
# Start one SuperNode against the SuperLink started by start_local.sh.
#
# Usage: deploy/start_supernode.sh PARTITION_ID [KEY_NAME]
#   PARTITION_ID  its partition-id (num-partitions comes from $RUN_DIR/state.env)
#   KEY_NAME      key pair in $KEY_DIR to authenticate with (default node-<PARTITION_ID>);
#                 created and registered if missing, so a new KEY_NAME for a
#                 partition that already ran simulates a re-provisioned board: a new
#                 node id with the same partition-id.
# Environment: as start_local.sh; REGISTER=0 skips registering the key (the SuperLink
#   then refuses the SuperNode: for tests), NODE_CONFIG_EXTRA (every SuperNode),
#   NODE_CONFIG_EXTRA_<PARTITION_ID> (this partition's only, appended after it, e.g.
#   NODE_CONFIG_EXTRA_3="step-seconds=0.4"), CLIENTAPP_MODE (warm:
#   flwr-gsgm-supernode --warm-executor, the default; per-message: flower-supernode),
#   SUPERNODE_START_TIMEOUT (seconds to wait for the SuperLink to take it, default 60).
# Returns once the SuperLink has activated the SuperNode ("SuperNode ID: N" in its log).
# Exits 1 with the SuperNode's own reason (Flower's "Exit Code: ..." lines) if it exited
# first, e.g. refused by the SuperLink (key not registered or already in use: code 305,
# a clock off: 401); exits 1 too after SUPERNODE_START_TIMEOUT seconds, leaving it
# running (it keeps retrying; stop_local.sh stops it).
# Writes $RUN_DIR/pids/supernode-<KEY_NAME>.pid and $RUN_DIR/logs/supernode-<KEY_NAME>.log.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]] || die "usage: start_supernode.sh PARTITION_ID [KEY_NAME]"
[[ -f "$RUN_DIR/state.env" ]] || die "no $RUN_DIR/state.env: run start_local.sh first"
source "$RUN_DIR/state.env"
pid_id="$1"
name="${2:-node-$pid_id}"
need setsid
words="$(supernode_command)"  # dies on a bad CLIENTAPP_MODE
mapfile -t command <<<"$words"
need "${command[0]}"
(( pid_id < NUM_PARTITIONS )) || die "partition-id $pid_id >= num-partitions $NUM_PARTITIONS"
if [[ -f "$RUN_DIR/pids/supernode-$name.pid" ]] && kill -0 "$(cat "$RUN_DIR/pids/supernode-$name.pid")" 2>/dev/null; then
  die "SuperNode $name already runs (PID $(cat "$RUN_DIR/pids/supernode-$name.pid"))"
fi

"$DEPLOY_DIR/make_node_keys.sh" -o "$KEY_DIR" "$name" >/dev/null
if [[ "${REGISTER:-1}" != 0 && ! -f "$RUN_DIR/nodes/$name.node-id" ]]; then
  "$DEPLOY_DIR/register_nodes.sh" -c "$CONNECTION" "$KEY_DIR/$name.pub" >/dev/null
fi

home="$RUN_DIR/supernode-$name"
mkdir -p "$home/cache"
node_config="partition-id=$pid_id num-partitions=$NUM_PARTITIONS cache-dir='$home/cache'"
node_config+="${NODE_CONFIG_EXTRA:+ $NODE_CONFIG_EXTRA}"
per_partition="NODE_CONFIG_EXTRA_$pid_id"  # e.g. one emulated device speed per partition
node_config+="${!per_partition:+ ${!per_partition}}"
FLWR_HOME="$home" start_daemon "supernode-$name" "$RUN_DIR/logs/supernode-$name.log" \
  "${command[@]}" \
  --superlink "$ADDRESS" \
  --root-certificates "$CERT_DIR/ca.crt" \
  --auth-supernode-private-key "$KEY_DIR/$name" \
  --node-config "$node_config" \
  --host 127.0.0.1 --port "$(free_port)"
pid="$(cat "$RUN_DIR/pids/supernode-$name.pid")"
log="$RUN_DIR/logs/supernode-$name.log"
# A refused SuperNode exits seconds after its start: report it started only once the
# SuperLink has activated it, so a board the SuperLink refuses is not counted as up.
timeout="${SUPERNODE_START_TIMEOUT:-60}"
[[ "$timeout" =~ ^[0-9]+$ ]] || die "SUPERNODE_START_TIMEOUT must be whole seconds, got '$timeout'"
deadline=$((SECONDS + timeout))
until node_id="$(sed -n 's/.*SuperNode ID: \([0-9]*\).*/\1/p' "$log" 2>/dev/null | tail -n 1)"; [[ -n "$node_id" ]]; do
  state="$(ps -o stat= -p "$pid" 2>/dev/null || true)"
  if [[ -z "$state" || "$state" == Z* ]]; then  # gone (or a zombie not reaped yet)
    code=0
    wait "$pid" 2>/dev/null || code=$?
    rm -f "$RUN_DIR/pids/supernode-$name.pid"
    reason="$(sed -n '/Exit Code:/,$p' "$log" | grep -v '^[[:space:]]*$' | head -n 12)"
    [[ -n "$reason" ]] || reason="$(tail -n 15 "$log")"
    die "SuperNode $name (partition-id $pid_id) exited with status $code before the SuperLink took it (log $log):
$reason"
  fi
  if ((SECONDS >= deadline)); then
    die "SuperNode $name (partition-id $pid_id, PID $pid) not activated by the SuperLink at $ADDRESS within SUPERNODE_START_TIMEOUT=$timeout s; it is still trying (log $log):
$(tail -n 5 "$log")"
  fi
  sleep 0.2
done
echo "SuperNode $name ($CLIENTAPP_MODE): partition-id $pid_id, node id $node_id (PID $pid, log $log)"
