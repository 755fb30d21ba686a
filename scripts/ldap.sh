#!/usr/bin/env bash
# A real LDAP directory for the identity tests: Debian's slapd on 127.0.0.1:PORT, its
# configuration (cn=config) and data generated under one folder (no debconf, no system
# slapd touched), StartTLS on PORT and LDAPS on TLS_PORT with a self-signed CA generated
# there, and every operation on the data refused without TLS (olcSecurity tls=1). Seeded with people and groups:
#
#   dc=corp,dc=test
#     ou=people:   uid=carol (carol-pw), uid=dave (dave-pw), uid=erin (erin-pw),
#                  uid=heteroflow-bind (bind-pw: the service account a bind DN names)
#     ou=groups:   cn=gpu-users (carol, erin), cn=gpu-admins (erin), cn=sales (dave)
#   cn=admin,dc=corp,dc=test (admin-pw) writes; everyone may search (anonymous search too)
#
#   scripts/ldap.sh [--install] start [DIR]   start (or reuse) it, print the env to eval
#   scripts/ldap.sh stop [DIR]                stop it (its data stays in DIR)
#   scripts/ldap.sh env [DIR]                 print the env to eval (no start)
#   scripts/ldap.sh status [DIR]              exit 0 when it answers over StartTLS
#
#   eval "$(scripts/ldap.sh --install start)"   # then HETEROFLOW_TEST_LDAP_URI is set
#
# DIR defaults to $HETEROFLOW_LDAP_DIR or ${TMPDIR:-/tmp}/heteroflow-ldap; the port to
# $HETEROFLOW_LDAP_PORT or 3389, the LDAPS one to $HETEROFLOW_LDAPS_PORT or 3636. --install (as root) installs with apt what is missing
# (slapd ldap-utils openssl, and for the control plane's LDAP client libldap2-dev
# libsasl2-dev gcc), then requirements/ldap.txt (django-auth-ldap, python-ldap) into
# $VENV (default .venv), python-ldap's wheel built once and kept under
# ~/.cache/heteroflow/wheels. Only export lines go to stdout.
set -euo pipefail

install=0
args=()
for a in "$@"; do
  case "$a" in
    --install) install=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
cmd="${args[0]:-}"
DIR="${args[1]:-${HETEROFLOW_LDAP_DIR:-${TMPDIR:-/tmp}/heteroflow-ldap}}"
case "$cmd" in start|stop|env|status) ;; *)
  echo "usage: $0 [--install] start|stop|env|status [DIR]" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PORT="${HETEROFLOW_LDAP_PORT:-3389}"
TLS_PORT="${HETEROFLOW_LDAPS_PORT:-3636}"
URI="ldap://127.0.0.1:$PORT"
LDAPS_URI="ldaps://127.0.0.1:$TLS_PORT"
BASE="dc=corp,dc=test"
CONF="$DIR/slapd.d"
DATA="$DIR/data"
TLS="$DIR/tls"
PIDFILE="$DIR/slapd.pid"
LOG="$DIR/slapd.log"
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/heteroflow/wheels"

log() { echo "ldap: $*" >&2; }

print_env() {
  echo "export HETEROFLOW_TEST_LDAP_URI=$URI"
  echo "export HETEROFLOW_TEST_LDAPS_URI=$LDAPS_URI"
  echo "export HETEROFLOW_TEST_LDAP_CA_FILE=$TLS/ca.crt"
  echo "export HETEROFLOW_TEST_LDAP_BASE=$BASE"
}

answers() {
  LDAPTLS_CACERT="$TLS/ca.crt" ldapsearch -x -ZZ -H "$URI" -b "$BASE" -s base -o nettimeout=3 dn >/dev/null 2>&1 \
    && LDAPTLS_CACERT="$TLS/ca.crt" ldapsearch -x -H "$LDAPS_URI" -b "$BASE" -s base -o nettimeout=3 dn >/dev/null 2>&1
}

slapd_pid() {
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # only ours: never kill an unrelated process that reused the pid
  if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "slapd.*$CONF"; then
    echo "$pid"
  fi
}

apt_install() {
  [ $# -eq 0 ] && return 0
  if [ "$install" != 1 ] || [ "$(id -u)" != 0 ]; then
    log "missing: $* (run with --install as root, or apt-get install -y $*)"
    return 1
  fi
  log "installing $*"
  export DEBIAN_FRONTEND=noninteractive
  # no debconf questions, and no system directory: this script makes its own
  echo "slapd slapd/no_configuration boolean true" | debconf-set-selections 2>/dev/null || true
  apt-get install -y -qq "$@" >"$DIR/apt.log" 2>&1 \
    || { apt-get update -qq >>"$DIR/apt.log" 2>&1 || true; apt-get install -y -qq "$@" >>"$DIR/apt.log" 2>&1; } \
    || { log "apt-get install failed:"; tail -5 "$DIR/apt.log" >&2; return 1; }
}

install_missing() {
  local pkgs=()
  [ -x /usr/sbin/slapd ] || pkgs+=(slapd)
  command -v ldapsearch >/dev/null 2>&1 || pkgs+=(ldap-utils)
  command -v openssl >/dev/null 2>&1 || pkgs+=(openssl)
  if [ "$install" = 1 ]; then
    [ -e /usr/include/ldap.h ] || pkgs+=(libldap2-dev)
    [ -e /usr/include/sasl/sasl.h ] || pkgs+=(libsasl2-dev)
    command -v gcc >/dev/null 2>&1 || pkgs+=(gcc)
  fi
  apt_install "${pkgs[@]}"
  # a system slapd the package may have started is not ours to keep running
  if [ "$install" = 1 ] && [ "$(id -u)" = 0 ] && [ ${#pkgs[@]} -gt 0 ]; then
    service slapd stop >/dev/null 2>&1 || true
  fi
  install_client
}

# The control plane's LDAP client in $VENV (with --install): also when the directory is up
# already, since a fresh checkout's venv has none.
install_client() {
  if [ "$install" = 1 ] && [ ! -x "$VENV/bin/python" ] && [ "$VENV" = "$REPO/.venv" ]; then
    log "no $VENV yet: make install first"
    make -C "$REPO" --no-print-directory install >&2
  fi
  if [ "$install" = 1 ] && [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "import django_auth_ldap, ldap" 2>/dev/null; then
    log "installing requirements/ldap.txt into $VENV (python-ldap's wheel cached in $WHEELS)"
    mkdir -p "$WHEELS"
    "$VENV/bin/python" -m pip wheel --quiet --disable-pip-version-check -w "$WHEELS" -r "$REPO/requirements/ldap.txt" >"$DIR/pip.log" 2>&1 \
      && "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --find-links "$WHEELS" -r "$REPO/requirements/ldap.txt" >>"$DIR/pip.log" 2>&1 \
      || { log "pip install -r requirements/ldap.txt failed:"; tail -5 "$DIR/pip.log" >&2; return 1; }
  fi
}

make_tls() {
  [ -f "$TLS/server.crt" ] && return 0
  mkdir -p "$TLS"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=HeteroFlow test LDAP CA" \
    -keyout "$TLS/ca.key" -out "$TLS/ca.crt" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$TLS/server.key" -out "$TLS/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n' >"$TLS/ext.cnf"
  openssl x509 -req -in "$TLS/server.csr" -CA "$TLS/ca.crt" -CAkey "$TLS/ca.key" -CAcreateserial -days 3650 \
    -extfile "$TLS/ext.cnf" -out "$TLS/server.crt" >/dev/null 2>&1
  chmod 600 "$TLS/server.key" "$TLS/ca.key"
}

make_directory() {
  [ -d "$CONF/cn=config" ] && return 0
  rm -rf "$CONF" "$DATA"
  mkdir -p "$CONF" "$DATA"
  cat >"$DIR/config.ldif" <<LDIF
dn: cn=config
objectClass: olcGlobal
cn: config
olcPidFile: $PIDFILE
olcTLSCACertificateFile: $TLS/ca.crt
olcTLSCertificateFile: $TLS/server.crt
olcTLSCertificateKeyFile: $TLS/server.key

dn: cn=module{0},cn=config
objectClass: olcModuleList
cn: module{0}
olcModulePath: /usr/lib/ldap
olcModuleLoad: back_mdb

dn: cn=schema,cn=config
objectClass: olcSchemaConfig
cn: schema

include: file:///etc/ldap/schema/core.ldif
include: file:///etc/ldap/schema/cosine.ldif
include: file:///etc/ldap/schema/inetorgperson.ldif

dn: olcDatabase={-1}frontend,cn=config
objectClass: olcDatabaseConfig
objectClass: olcFrontendConfig
olcDatabase: {-1}frontend

dn: olcDatabase={0}config,cn=config
objectClass: olcDatabaseConfig
olcDatabase: {0}config
olcAccess: {0}to * by * none

dn: olcDatabase={1}mdb,cn=config
objectClass: olcDatabaseConfig
objectClass: olcMdbConfig
olcDatabase: {1}mdb
olcSuffix: $BASE
olcRootDN: cn=admin,$BASE
olcRootPW: admin-pw
olcDbDirectory: $DATA
olcSecurity: tls=1
olcAccess: {0}to attrs=userPassword by self read by anonymous auth by * none
olcAccess: {1}to * by * read
LDIF
  slapadd -n 0 -F "$CONF" -l "$DIR/config.ldif" >"$DIR/slapadd.log" 2>&1 \
    || { log "slapadd of the configuration failed:"; tail -5 "$DIR/slapadd.log" >&2; return 1; }
  person() {
    printf 'dn: uid=%s,ou=people,%s\nobjectClass: inetOrgPerson\nuid: %s\ncn: %s\nsn: %s\nmail: %s@corp.test\nuserPassword: %s\n\n' \
      "$1" "$BASE" "$1" "$1" "$1" "$1" "$2"
  }
  group() {
    local name="$1"; shift
    printf 'dn: cn=%s,ou=groups,%s\nobjectClass: groupOfNames\ncn: %s\n' "$name" "$BASE" "$name"
    for member in "$@"; do printf 'member: uid=%s,ou=people,%s\n' "$member" "$BASE"; done
    printf '\n'
  }
  {
    printf 'dn: %s\nobjectClass: dcObject\nobjectClass: organization\ndc: corp\no: Corp\n\n' "$BASE"
    printf 'dn: ou=people,%s\nobjectClass: organizationalUnit\nou: people\n\n' "$BASE"
    printf 'dn: ou=groups,%s\nobjectClass: organizationalUnit\nou: groups\n\n' "$BASE"
    person carol carol-pw
    person dave dave-pw
    person erin erin-pw
    person heteroflow-bind bind-pw
    group gpu-users carol erin
    group gpu-admins erin
    group sales dave
  } >"$DIR/seed.ldif"
  slapadd -n 1 -F "$CONF" -l "$DIR/seed.ldif" >>"$DIR/slapadd.log" 2>&1 \
    || { log "slapadd of the people and groups failed:"; tail -5 "$DIR/slapadd.log" >&2; return 1; }
}

start() {
  if answers; then
    install_client
    print_env
    return 0
  fi
  # one start at a time (the test workers may each ask): the others find it up
  exec 9>"$DIR/start.lock"
  flock -w 120 9
  if answers; then
    print_env
    return 0
  fi
  install_missing
  make_tls
  make_directory
  # ours, but not answering on both addresses (an older start's): start it again
  old="$(slapd_pid)"
  if [ -n "$old" ]; then kill "$old"; sleep 0.5; fi
  setsid /usr/sbin/slapd -F "$CONF" -h "$URI/ $LDAPS_URI/" -d 0 >"$LOG" 2>&1 </dev/null 9>&- &
  for _ in $(seq 1 100); do
    if answers; then
      log "up at $URI (StartTLS) and $LDAPS_URI (log: $LOG)"
      print_env
      return 0
    fi
    sleep 0.1
  done
  log "did not answer at $URI within 10 s:"; tail -20 "$LOG" >&2
  return 1
}

case "$cmd" in
  start) start ;;
  env) print_env ;;
  status) answers ;;
  stop)
    pid="$(slapd_pid)"
    if [ -n "$pid" ]; then kill "$pid"; log "stopped ($pid)"; fi
    ;;
esac
