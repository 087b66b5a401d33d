#!/usr/bin/env bash
# Create a private CA and a SuperLink TLS server certificate (OpenSSL).
#
# Usage: deploy/make_certs.sh [OUT_DIR] [EXTRA_SAN ...]
#   OUT_DIR    where to write the files (default: deploy/certs, git-ignored)
#   EXTRA_SAN  extra subjectAltName entries for a SuperLink reachable from other
#              machines, e.g. IP:192.168.1.10 DNS:superlink.lan
#
# Writes:
#   ca.crt      CA certificate: give it to every SuperNode (--root-certificates)
#               and to the flwr CLI (root-certificates in $FLWR_HOME/config.toml)
#   ca.key      CA private key: keep it off the boards
#   server.pem  SuperLink certificate for 127.0.0.1, ::1 and localhost (+ EXTRA_SAN)
#   server.key  SuperLink private key
# flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/certs}"
shift || true
days="${CERT_DAYS:-365}"

command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }
mkdir -p "$out"
chmod 700 "$out"

san="IP:127.0.0.1,IP:::1,DNS:localhost"
for extra in "$@"; do
  san="$san,$extra"
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# 1. CA (self-signed, may sign certificates only)
openssl req -x509 -new -newkey rsa:3072 -nodes -sha256 -days "$days" \
  -subj "/CN=flwr-gsgm local CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null

# 2. SuperLink key and signing request
openssl req -new -newkey rsa:3072 -nodes -sha256 \
  -subj "/CN=localhost" \
  -keyout "$out/server.key" -out "$tmp/server.csr" 2>/dev/null

# 3. SuperLink certificate signed by the CA, with SANs (TLS clients check the SAN)
cat > "$tmp/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
openssl x509 -req -in "$tmp/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -CAserial "$tmp/ca.srl" -days "$days" -sha256 \
  -extfile "$tmp/server.ext" -out "$out/server.pem" 2>/dev/null

chmod 600 "$out/ca.key" "$out/server.key"
chmod 644 "$out/ca.crt" "$out/server.pem"
openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "certificates in $out (SAN: $san)"
