# Shared settings and helpers of the deploy/ scripts (sourced, not run).
#
# Environment (all optional):
#   RUN_DIR      run folder: logs, PIDs, state (default deploy/run, git-ignored)
#   CERT_DIR     TLS files from make_certs.sh (default deploy/certs, git-ignored)
#   KEY_DIR      SuperNode key pairs from make_node_keys.sh (default deploy/keys, git-ignored)
#   CONNECTION   name of the SuperLink connection in $FLWR_HOME/config.toml (default gsgm-local)
#   FLWR_HOME    Flower CLI home holding config.toml (default $RUN_DIR/flwr-home)
#   VENV         virtualenv whose bin/ has flwr, flower-superlink, flower-supernode and
#                flwr-gsgm-supernode (default: the repo's .venv if it exists, else PATH)
#   CLIENTAPP_MODE  warm (default) or per-message: see below

DEPLOY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$DEPLOY_DIR/.." && pwd)"
RUN_DIR="${RUN_DIR:-$DEPLOY_DIR/run}"
CERT_DIR="${CERT_DIR:-$DEPLOY_DIR/certs}"
KEY_DIR="${KEY_DIR:-$DEPLOY_DIR/keys}"
CONNECTION="${CONNECTION:-gsgm-local}"
# Absolute paths: the daemons run from the repository folder.
RUN_DIR="$(realpath -m "$RUN_DIR")"
CERT_DIR="$(realpath -m "$CERT_DIR")"
KEY_DIR="$(realpath -m "$KEY_DIR")"
FLWR_HOME="$(realpath -m "${FLWR_HOME:-$RUN_DIR/flwr-home}")"
export FLWR_HOME
# Never let a Flower process install app dependencies at run time (offline boards, CI).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
# No telemetry and no update checks from any Flower process (offline boards, privacy).
export FLWR_TELEMETRY_ENABLED="${FLWR_TELEMETRY_ENABLED:-0}"
export FLWR_DISABLE_UPDATE_CHECK="${FLWR_DISABLE_UPDATE_CHECK:-1}"
# Per-message mode only: Flower's SuperExec asks for a new task every 0.1 s instead of 1 s
# (0.01 costs ~30% of a core per idle SuperNode).
export FLWR_SUPEREXEC_TASK_POLL_INTERVAL="${FLWR_SUPEREXEC_TASK_POLL_INTERVAL:-0.1}"
# How a SuperNode runs its ClientApp (start_supernode.sh):
#   warm         flwr-gsgm-supernode --warm-executor: one long-lived flwr-gsgm-executor
#                serves every message, the ClientApp imported once (the default);
#   per-message  stock flower-supernode: a new flwr-clientapp process per message.
CLIENTAPP_MODE="${CLIENTAPP_MODE:-warm}"

if [[ -n "${VENV:-}" ]]; then
  PATH="$VENV/bin:$PATH"
elif [[ -x "$REPO_DIR/.venv/bin/flower-superlink" ]]; then
  PATH="$REPO_DIR/.venv/bin:$PATH"
fi
export PATH
PYTHON="$(command -v python3 || command -v python)"

die() { echo "${0##*/}: $*" >&2; exit 1; }

need() {
  local cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null || die "$cmd not found (activate the venv or set VENV=...)"
  done
}

# free_port: print a TCP port on 127.0.0.1 that nobody listens on right now.
free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# wait_health ADDRESS CA_FILE TIMEOUT: wait until https://ADDRESS/health answers.
wait_health() {
  "$PYTHON" - "$1" "$2" "$3" <<'PY'
import ssl, sys, time, urllib.request
address, ca, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
ctx = ssl.create_default_context(cafile=ca)
deadline = time.monotonic() + timeout
while True:
    try:
        with urllib.request.urlopen(f"https://{address}/health", context=ctx, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception as err:  # not up yet
        last = err
    if time.monotonic() > deadline:
        sys.exit(f"SuperLink at {address} not healthy after {timeout:.0f} s: {last}")
    time.sleep(0.5)
PY
}

# start_daemon NAME LOGFILE CMD...: start CMD in its own session (so that a terminal's
# Ctrl-C does not reach it and stop_local.sh can stop its process group); write its
# PID to $RUN_DIR/pids/NAME.pid.
# It runs in the repository folder: a relative output-dir of the ServerApp (started
# by the SuperLink) lands in the repository's git-ignored outputs/.
start_daemon() {
  local name="$1" logfile="$2"
  shift 2
  mkdir -p "$RUN_DIR/pids" "$(dirname "$logfile")"
  (cd "$REPO_DIR" && exec setsid "$@" >"$logfile" 2>&1 </dev/null) &
  echo $! >"$RUN_DIR/pids/$name.pid"
}

# descendants PID: print PID and all its descendants (one per line).
descendants() {
  local pid="$1" child
  echo "$pid"
  for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do
    descendants "$child"
  done
}

# write_connection FILE NAME ADDRESS CA: add or replace [superlink.NAME] in the Flower
# config FILE, keeping everything else; make it the default if none is set.
write_connection() {
  "$PYTHON" - "$@" <<'PY'
import sys
from pathlib import Path
import tomli, tomli_w
path, name, address, ca = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config = tomli.loads(path.read_text()) if path.is_file() else {}
superlink = config.setdefault("superlink", {})
superlink[name] = {"address": address, "root-certificates": ca}
superlink.setdefault("default", name)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(tomli_w.dumps(config))
PY
}

# supernode_command: print the command (one word per line) that starts a SuperNode in
# $CLIENTAPP_MODE, before flower-supernode's own flags.
supernode_command() {
  case "$CLIENTAPP_MODE" in
    warm)
      if command -v flwr-gsgm-supernode >/dev/null; then
        printf '%s\n' flwr-gsgm-supernode --warm-executor --preload torch
      else  # a source checkout whose scripts are not installed
        printf '%s\n' "$PYTHON" -m flwr_gsgm.deploy.supernode --warm-executor --preload torch
      fi ;;
    per-message) printf '%s\n' flower-supernode ;;
    *) die "CLIENTAPP_MODE must be warm or per-message, got '$CLIENTAPP_MODE'" ;;
  esac
}
