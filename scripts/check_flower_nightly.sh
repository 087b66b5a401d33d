#!/usr/bin/env bash
# Run the engine and simulation tests against flwr-nightly (the next Flower release),
# not part of CI: docs/PORTING.md "Flower 1.43".
#
#   bash scripts/check_flower_nightly.sh [VENV] [PYTEST ARGS...]
#
# VENV (default /tmp/flwr-nightly-venv) gets flwr-nightly from the package index and
# sees every other package of this project's .venv (numpy, torch, ... through a folder of
# links, flwr itself left out), so nothing big is installed twice. The project is
# imported from this checkout (PYTHONPATH), never installed: its dependency on flwr
# (another name than flwr-nightly) would make pip add flwr 1.42 over the nightly.
# Default tests: the library's test folders that run the engine on Flower (those of
# NIGHTLY_TESTS below) and tests/simulation_engine (flwr run with the nightly's CLI).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/flwr-nightly-venv}"
shift || true
BASE="$ROOT/.venv"
[ -x "$BASE/bin/python" ] || { echo "no $BASE: run 'make setup' first" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE/bin/python" -m venv "$VENV"
  # a pre-release specifier allows pre-releases of flwr-nightly only (--pre would take
  # pre-releases of its dependencies too, e.g. a grpcio-health-checking for protobuf 7)
  "$VENV/bin/pip" install --quiet "flwr-nightly>=1.43.0.dev0"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHARED="$VENV/shared-site"
rm -rf "$SHARED" && mkdir -p "$SHARED"
PURELIB="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for entry in "$PURELIB"/*; do
  name="$(basename "$entry")"
  case "$name" in
    flwr|flwr-*.dist-info|flwr_gsgm*|__editable__*|*.pth) continue ;;
  esac
  # what flwr-nightly brought in its own version (protobuf, grpcio, ...) stays its own
  [ -e "$SITE/$name" ] && continue
  case "$name" in
    *.dist-info) compgen -G "$SITE/${name%%-*}-*.dist-info" >/dev/null && continue ;;
  esac
  ln -s "$entry" "$SHARED/$name"
done
echo "$SHARED" > "$SITE/project-deps.pth"
echo "flwr in $VENV: $("$VENV/bin/python" -c 'import flwr; print(flwr.__version__, flwr.__file__)')"
cd "$ROOT"
NIGHTLY_TESTS=(tests/engine tests/config tests/strategy tests/nodes tests/intake tests/model
  tests/checkpoint tests/scheduling tests/simulation tests/serverapp
  tests/packaging/test_private_apis.py tests/packaging/test_architecture_doc.py)
if [ "$#" -eq 0 ]; then set -- "${NIGHTLY_TESTS[@]}" tests/simulation_engine -q; fi
PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest "$@"
