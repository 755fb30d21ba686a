#!/usr/bin/env bash
# A real image registry for the image channel's tests: Debian's distribution registry
# (`docker-registry`) on 127.0.0.1:PORT, its data under one folder, seeded with small
# busybox-based images built here and pushed to it.
#
#   scripts/registry.sh [--install] start [DIR]   start (or reuse) the registry, push the test
#                                                 images when missing, print the env to eval
#   scripts/registry.sh stop [DIR]                stop it (its data stays in DIR)
#   scripts/registry.sh env [DIR]                 print the env to eval (no start)
#   scripts/registry.sh status [DIR]              exit 0 when the registry answers /v2/
#   scripts/registry.sh seed [DIR]                build and push the test images again
#
#   eval "$(scripts/registry.sh --install start)"   # then HETEROFLOW_TEST_REGISTRY is set
#
# DIR defaults to $HETEROFLOW_REGISTRY_DIR or ${TMPDIR:-/tmp}/heteroflow-registry; the port
# to $HETEROFLOW_REGISTRY_PORT, else the one DIR's registry last started on, else 5055. --install runs `apt-get install -y docker-registry
# skopeo podman runc busybox-static` for what is missing, when running as root. Only the export
# lines go to stdout; progress and errors go to stderr.
#
# The engine pulls from it over plain HTTP, so the registry is marked insecure in
# DIR/registries.conf; CONTAINERS_REGISTRIES_CONF names that file, and
# scripts/container-engine.sh hands it to the Podman service it starts. Start the
# registry BEFORE the engine (a running service keeps the registries.conf it started with;
# container-engine.sh warns when it reuses one that lacks it).
#
# The images (REG = 127.0.0.1:PORT):
#   REG/heteroflow/probe:1.0 and REG/heteroflow/probe:latest   busybox (one layer), same image
#   REG/heteroflow/probe:2.0                                    busybox + a 4 MiB layer
#   REG/heteroflow/other:1.0                                    busybox (a second repository)
# They are built with podman in a storage of DIR's own (not the engine's), so the engine
# under test has none of them until it pulls.
set -euo pipefail

install=0
args=()
for a in "$@"; do
  case "$a" in
    --install) install=1 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
cmd="${args[0]:-}"
DIR="${args[1]:-${HETEROFLOW_REGISTRY_DIR:-${TMPDIR:-/tmp}/heteroflow-registry}}"
case "$cmd" in start|stop|env|status|seed) ;; *)
  echo "usage: $0 [--install] start|stop|env|status|seed [DIR]" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
# the port: $HETEROFLOW_REGISTRY_PORT, else the one this DIR's registry was started on, else 5055
PORT="${HETEROFLOW_REGISTRY_PORT:-$(cat "$DIR/port" 2>/dev/null || echo 5055)}"
ADDR="127.0.0.1:$PORT"
CONFIG="$DIR/config.yml"
REGISTRIES_CONF="$DIR/registries.conf"
PIDFILE="$DIR/registry.pid"
LOG="$DIR/registry.log"
BUILD="$DIR/build"
RUNROOT="/tmp/hf-registry-$(printf %s "$DIR" | md5sum | cut -c1-12)"  # podman wants a short one

log() { echo "registry: $*" >&2; }

print_env() {
  echo "export HETEROFLOW_TEST_REGISTRY=$ADDR"
  echo "export CONTAINERS_REGISTRIES_CONF=$REGISTRIES_CONF"
}

answers() {
  [ "$(curl -s --max-time 3 "http://$ADDR/v2/" 2>/dev/null)" = "{}" ]
}

registry_pid() {
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # only our registry: never kill an unrelated process that reused the pid
  if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "serve $CONFIG"; then
    echo "$pid"
  fi
}

install_missing() {
  local pkgs=()
  command -v docker-registry >/dev/null 2>&1 || pkgs+=(docker-registry)
  command -v skopeo >/dev/null 2>&1 || pkgs+=(skopeo)
  command -v podman >/dev/null 2>&1 || pkgs+=(podman)
  command -v runc >/dev/null 2>&1 || pkgs+=(runc)
  command -v curl >/dev/null 2>&1 || pkgs+=(curl)
  static_busybox >/dev/null || pkgs+=(busybox-static)
  [ ${#pkgs[@]} -eq 0 ] && return 0
  if [ "$install" != 1 ]; then
    log "missing: ${pkgs[*]} (run with --install as root, or apt-get install -y ${pkgs[*]})"
    return 1
  fi
  if [ "$(id -u)" != 0 ]; then
    log "missing: ${pkgs[*]}, and --install needs root"
    return 1
  fi
  log "installing ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq "${pkgs[@]}" >"$DIR/apt.log" 2>&1; then
    apt-get update -qq >>"$DIR/apt.log" 2>&1 || true
    if ! apt-get install -y -qq "${pkgs[@]}" >>"$DIR/apt.log" 2>&1; then
      log "apt-get install failed:"; tail -5 "$DIR/apt.log" >&2
      return 1
    fi
  fi
}

static_busybox() {
  local candidate
  for candidate in /bin/busybox "$(command -v busybox 2>/dev/null || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && ! ldd "$candidate" >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

write_config() {
  mkdir -p "$DIR/data"
  echo "$PORT" >"$DIR/port"
  cat >"$CONFIG" <<EOF
# Written by scripts/registry.sh: the image channel's test registry.
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $DIR/data
  delete:
    enabled: true
http:
  addr: $ADDR
EOF
  cat >"$REGISTRIES_CONF" <<EOF
# Written by scripts/registry.sh: the test registry speaks plain HTTP.
[[registry]]
location = "$ADDR"
insecure = true
EOF
}

# podman on DIR's own storage (the build side; the engine under test has its own)
build_podman() {
  CONTAINERS_REGISTRIES_CONF="$REGISTRIES_CONF" podman \
    --root "$BUILD/storage" --runroot "$RUNROOT" --tmpdir "$BUILD/tmp" \
    --storage-driver vfs --cgroup-manager cgroupfs --events-backend file \
    "$@"
}

tags_of() {  # the registry's tags of a repository, one a line
  curl -s --max-time 5 "http://$ADDR/v2/$1/tags/list" | tr -d ' \n' |
    sed -n 's/.*"tags":\[\([^]]*\)\].*/\1/p' | tr ',' '\n' | tr -d '"'
}

seeded() {
  local t
  t="$(tags_of heteroflow/probe)"
  for want in 1.0 2.0 latest; do grep -qx "$want" <<<"$t" || return 1; done
  grep -qx 1.0 <<<"$(tags_of heteroflow/other)"
}

seed() {
  local bb root applet
  bb="$(static_busybox)" || { log "no statically linked busybox (apt-get install busybox-static)"; return 1; }
  rm -rf "$BUILD" "$RUNROOT"
  mkdir -p "$BUILD/storage" "$BUILD/tmp" "$RUNROOT"
  root="$BUILD/root"
  mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/proc" "$root/sys" "$root/dev"
  chmod 1777 "$root/tmp"
  cp "$bb" "$root/bin/busybox"
  for applet in $("$root/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
  echo 'root:x:0:' >"$root/etc/group"
  tar -C "$root" -cf "$BUILD/base.tar" .
  build_podman import -q --change 'ENV PATH=/bin' --change 'CMD ["/bin/sh"]' \
    "$BUILD/base.tar" localhost/hf-probe:base >/dev/null
  # 2.0: one more layer, incompressible, so a pull of it has bytes to report
  mkdir -p "$BUILD/ctx"
  head -c 4194304 /dev/urandom >"$BUILD/ctx/payload.bin"
  printf 'FROM localhost/hf-probe:base\nCOPY payload.bin /payload.bin\n' >"$BUILD/ctx/Containerfile"
  build_podman build -q --runtime runc --isolation chroot -t localhost/hf-probe:two "$BUILD/ctx" >/dev/null
  local ref
  for ref in "localhost/hf-probe:base heteroflow/probe:1.0" "localhost/hf-probe:base heteroflow/probe:latest" \
    "localhost/hf-probe:two heteroflow/probe:2.0" "localhost/hf-probe:base heteroflow/other:1.0"; do
    set -- $ref
    build_podman push -q --tls-verify=false "$1" "$ADDR/$2" >/dev/null
  done
  # skopeo reads them back: what the registry serves is what the tests will pull
  skopeo inspect --tls-verify=false "docker://$ADDR/heteroflow/probe:2.0" >/dev/null
  build_podman rmi -a -f >/dev/null 2>&1 || true
  rm -rf "$BUILD" "$RUNROOT"
  log "pushed heteroflow/probe:{1.0,latest,2.0} and heteroflow/other:1.0 to $ADDR"
}

# its own session, its fds on the log: nothing of this script waits for it or holds its output
launch_registry() {
  cd /
  setsid docker-registry serve "$CONFIG" </dev/null >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
}

cmd_start() {
  install_missing || exit 1
  write_config
  if answers; then
    log "reusing the registry on $ADDR"
  else
    local old
    old="$(registry_pid)"
    if [ -n "$old" ]; then kill "$old" 2>/dev/null || true; fi
    log "starting docker-registry on $ADDR (data: $DIR/data, log: $LOG)"
    (launch_registry)
    local pid i
    pid="$(cat "$PIDFILE")"
    for i in $(seq 1 100); do
      answers && break
      if ! kill -0 "$pid" 2>/dev/null; then
        log "the registry exited; its log:"; tail -20 "$LOG" >&2
        exit 1
      fi
      sleep 0.1
    done
    if ! answers; then
      log "the registry did not answer on $ADDR within 10 s; its log:"; tail -20 "$LOG" >&2
      exit 1
    fi
  fi
  if ! seeded; then
    seed || exit 1
  fi
  print_env
}

cmd_stop() {
  local pid
  pid="$(registry_pid)"
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "stopped the registry (pid $pid)"
  fi
  rm -f "$PIDFILE"
}

case "$cmd" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  env) print_env ;;
  status) answers ;;
  seed) install_missing || exit 1; write_config; answers || { log "not running on $ADDR"; exit 1; }; seed; print_env ;;
esac
