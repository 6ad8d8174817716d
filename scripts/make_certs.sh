#!/usr/bin/env bash
# Makes a self-signed CA, a learner certificate and an actor (client) certificate,
# for TLS between actors and the learner in tests or on a private network.
#
# Usage: scripts/make_certs.sh DIR [HOSTNAME...]
#   DIR       where ca.pem, learner.pem, learner.key, actor.pem and actor.key go
#   HOSTNAME  names the learner's certificate is valid for, besides localhost,
#             127.0.0.1 and ::1 (for instance the learner machine's name)
#
#   seedrl-learner ... --tls-cert DIR/learner.pem --tls-key DIR/learner.key \
#                      [--tls-client-ca DIR/ca.pem]
#   seedrl-actor ...   --tls-ca DIR/ca.pem [--tls-cert DIR/actor.pem --tls-key DIR/actor.key]
#
# Keys are unencrypted and readable by the owner only. For production, use your
# organisation's CA instead.
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "make_certs: openssl is needed" >&2; exit 1; }
dir=$1
shift
mkdir -p "$dir"
umask 077
names="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
  if [[ "$host" =~ ^[0-9.]+$ || "$host" == *:* ]]; then names+=",IP:$host"; else names+=",DNS:$host"; fi
done
days=825
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -subj "/CN=seedrl test CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
issue() {  # name, common name, extensions
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
    -keyout "$dir/$1.key" -out "$dir/$1.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -out "$dir/$1.pem" -extfile <(printf '%s\n' "$3") 2>/dev/null
  rm -f "$dir/$1.csr"
}
issue learner "seedrl learner" "subjectAltName=$names
extendedKeyUsage=serverAuth"
issue actor "seedrl actor" "extendedKeyUsage=clientAuth"
rm -f "$dir/ca.srl"
chmod 644 "$dir"/*.pem
echo "make_certs: wrote $dir/{ca.pem,learner.pem,learner.key,actor.pem,actor.key} (learner valid for $names)" >&2
