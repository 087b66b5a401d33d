#!/usr/bin/env bash
# Create SuperNode authentication key pairs in the format Flower 1.42 expects:
# an ECDSA key on a NIST curve (P-384 here) in OpenSSH format, private key without
# passphrase, public key as one "ecdsa-sha2-nistp384 AAAA... comment" line.
#
# Usage: deploy/make_node_keys.sh [-o KEY_DIR] [-f] N | NAME...
#   N        create node-0 ... node-<N-1>
#   NAME...  create keys with these names (e.g. node-2-replacement)
#   -o DIR   output folder (default $KEY_DIR or deploy/keys, git-ignored)
#   -f       overwrite existing keys (default: keep them)
#
# Writes DIR/NAME (private key, mode 600: stays on the SuperNode, passed with
# --auth-supernode-private-key) and DIR/NAME.pub (public key: registered with the
# SuperLink by `flwr supernode register DIR/NAME.pub <connection>`, see
# register_nodes.sh; a SuperLink started with --enable-supernode-auth refuses
# every SuperNode whose public key was not registered).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

force=0
while getopts "o:f" opt; do
  case "$opt" in
    o) KEY_DIR="$OPTARG" ;;
    f) force=1 ;;
    *) die "usage: make_node_keys.sh [-o KEY_DIR] [-f] N | NAME..." ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || die "usage: make_node_keys.sh [-o KEY_DIR] [-f] N | NAME..."

names=()
if [[ $# -eq 1 && "$1" =~ ^[0-9]+$ ]]; then
  for ((i = 0; i < $1; i++)); do names+=("node-$i"); done
else
  names=("$@")
fi

mkdir -p "$KEY_DIR"
chmod 700 "$KEY_DIR"
for name in "${names[@]}"; do
  [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad key name: $name"
  key="$KEY_DIR/$name"
  if [[ -f "$key" && -f "$key.pub" && $force -eq 0 ]]; then
    echo "kept    $key"
    continue
  fi
  rm -f "$key" "$key.pub"
  if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "$name" -f "$key"
  else  # the cryptography package comes with flwr
    "$PYTHON" - "$key" "$name" <<'PY'
import os, sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
path, comment = sys.argv[1], sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                            serialization.NoEncryption())
public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                       serialization.PublicFormat.OpenSSH)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "wb") as fh:
    fh.write(private)
with open(path + ".pub", "wb") as fh:
    fh.write(public + b" " + comment.encode() + b"\n")
PY
  fi
  chmod 600 "$key"
  echo "created $key (+ .pub)"
done
