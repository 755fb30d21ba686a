#!/usr/bin/env bash
# A real OpenID provider for the identity tests: npm's `oidc-provider` on Node.js
# (scripts/oidc-provider.mjs) on 127.0.0.1:PORT, with one client (`heteroflow`) and the
# people of DIR/users.json (rewritten by the tests).
#
#   scripts/oidc-provider.sh [--install] start [DIR]   start (or reuse) it, print the env to eval
#   scripts/oidc-provider.sh stop [DIR]                stop it
#   scripts/oidc-provider.sh env [DIR]                 print the env to eval (no start)
#   scripts/oidc-provider.sh status [DIR]              exit 0 when its discovery document answers
#
#   eval "$(scripts/oidc-provider.sh --install start)"   # then HETEROFLOW_TEST_OIDC_ISSUER is set
#
# DIR defaults to $HETEROFLOW_OIDC_DIR or ${TMPDIR:-/tmp}/heteroflow-oidc; the port to
# $HETEROFLOW_OIDC_PORT or 9400. The npm package is installed once per machine under
# /root/.cache/heteroflow/oidc-provider (or $XDG_CACHE_HOME/heteroflow/...); --install also
# installs Node.js with apt when it is missing (root). Only export lines go to stdout.
set -euo pipefail

VERSION=9.13.3
install=0
args=()
for a in "$@"; do
  case "$a" in
    --install) install=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
cmd="${args[0]:-}"
DIR="${args[1]:-${HETEROFLOW_OIDC_DIR:-${TMPDIR:-/tmp}/heteroflow-oidc}}"
case "$cmd" in start|stop|env|status) ;; *)
  echo "usage: $0 [--install] start|stop|env|status [DIR]" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
PORT="${HETEROFLOW_OIDC_PORT:-9400}"
ISSUER="http://127.0.0.1:$PORT"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/heteroflow/oidc-provider-$VERSION"
MODULE="$CACHE/node_modules/oidc-provider/lib/index.js"
PIDFILE="$DIR/provider.pid"
LOG="$DIR/provider.log"
USERS="$DIR/users.json"
SECRET="heteroflow-test-secret"

log() { echo "oidc-provider: $*" >&2; }

print_env() {
  echo "export HETEROFLOW_TEST_OIDC_ISSUER=$ISSUER"
  echo "export HETEROFLOW_TEST_OIDC_USERS=$USERS"
  echo "export HETEROFLOW_TEST_OIDC_CLIENT_SECRET=$SECRET"
}

answers() {
  curl -sf --max-time 3 "$ISSUER/.well-known/openid-configuration" 2>/dev/null | grep -q '"issuer"'
}

provider_pid() {
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # only ours: never kill an unrelated process that reused the pid
  if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "oidc-provider.mjs"; then
    echo "$pid"
  fi
}

install_missing() {
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    if [ "$install" != 1 ] || [ "$(id -u)" != 0 ]; then
      log "node and npm are missing (run with --install as root, or apt-get install -y nodejs npm)"
      return 1
    fi
    log "installing nodejs npm"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq nodejs npm >"$DIR/apt.log" 2>&1 \
      || { apt-get update -qq >>"$DIR/apt.log" 2>&1 || true; apt-get install -y -qq nodejs npm >>"$DIR/apt.log" 2>&1; } \
      || { log "apt-get install failed:"; tail -5 "$DIR/apt.log" >&2; return 1; }
  fi
  if [ ! -f "$MODULE" ]; then
    if [ "$install" != 1 ]; then
      log "oidc-provider@$VERSION is not in $CACHE (run with --install)"
      return 1
    fi
    log "installing oidc-provider@$VERSION into $CACHE"
    mkdir -p "$CACHE"
    [ -f "$CACHE/package.json" ] || echo '{"name":"heteroflow-test-oidc-provider","private":true}' >"$CACHE/package.json"
    (cd "$CACHE" && npm install --no-audit --no-fund --loglevel=error "oidc-provider@$VERSION" >"$DIR/npm.log" 2>&1) \
      || { log "npm install failed:"; tail -5 "$DIR/npm.log" >&2; return 1; }
  fi
}

start() {
  if answers; then
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
  [ -f "$USERS" ] || echo '{}' >"$USERS"
  HF_OIDC_MODULE="$MODULE" HF_OIDC_PORT="$PORT" HF_OIDC_USERS="$USERS" HF_OIDC_CLIENT_SECRET="$SECRET" \
    setsid node "$HERE/oidc-provider.mjs" >"$LOG" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 100); do
    if answers; then
      log "up at $ISSUER (log: $LOG)"
      print_env
      return 0
    fi
    sleep 0.1
  done
  log "did not answer at $ISSUER within 10 s:"; tail -20 "$LOG" >&2
  return 1
}

case "$cmd" in
  start) start ;;
  env) print_env ;;
  status) answers ;;
  stop)
    pid="$(provider_pid)"
    if [ -n "$pid" ]; then kill "$pid"; log "stopped ($pid)"; fi
    rm -f "$PIDFILE"
    ;;
esac
