#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with --enable-supernode-auth.
#
# Usage: deploy/register_nodes.sh [-c CONNECTION] PUBLIC_KEY...
#   CONNECTION  SuperLink connection in $FLWR_HOME/config.toml (default gsgm-local)
#
# Prints "<key name> <node id>" per key; the node id is what the SuperNode gets when it
# connects with the matching private key. Registering is done once per key and
# SuperLink state: a SuperLink with --database FILE keeps its registrations across
# restarts, the default in-memory one forgets them. `flwr supernode ls CONNECTION`
# lists registered nodes and their status; `flwr supernode unregister NODE_ID
# CONNECTION` revokes one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

while getopts "c:" opt; do
  case "$opt" in
    c) CONNECTION="$OPTARG" ;;
    *) die "usage: register_nodes.sh [-c CONNECTION] PUBLIC_KEY..." ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || die "usage: register_nodes.sh [-c CONNECTION] PUBLIC_KEY..."
need flwr

for pub in "$@"; do
  [[ -f "$pub" ]] || die "no such public key file: $pub"
  name="$(basename "$pub" .pub)"
  out="$(flwr supernode register "$pub" "$CONNECTION" --name "$name" --format json 2>&1)" \
    || die "registering $pub failed: $out"
  node_id="$("$PYTHON" -c 'import json, sys
text = sys.stdin.read()
print(json.loads(text[text.index("{"):])["node-id"])' <<<"$out")" \
    || die "registering $pub: unexpected answer: $out"
  if [[ -d "$RUN_DIR" ]]; then
    mkdir -p "$RUN_DIR/nodes"
    echo "$node_id" >"$RUN_DIR/nodes/$name.node-id"
  fi
  echo "$name $node_id"
done
