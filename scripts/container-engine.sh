#!/usr/bin/env bash
# A real Docker-compatible engine for the agent's docker-runtime tests: Podman's Docker
# API service on a private Unix socket, with its own storage under one folder.
#
#   scripts/container-engine.sh [--install] start [DIR]   start (or reuse) the service, import
#                                                         the test image, print the env to eval
#   scripts/container-engine.sh stop [DIR]                remove its containers, stop the service
#   scripts/container-engine.sh env [DIR]                 print the env to eval (no start)
#   scripts/container-engine.sh status [DIR]              exit 0 when the service answers
#
#   eval "$(scripts/container-engine.sh --install start)"   # then DOCKER_HOST is set
#
# DIR defaults to $HETEROFLOW_ENGINE_DIR or ${TMPDIR:-/tmp}/heteroflow-container-engine.
# --install runs `apt-get install -y podman runc busybox-static` for what is missing, when
# running as root; without it nothing is installed. Only the export lines go to stdout;
# progress and errors go to stderr.
#
# Why these flags (see the project's RECIPES): the sandbox lacks CAP_SYS_RESOURCE, so
# containers must set no rlimits (default_ulimits = []); crun fails on hybrid cgroups,
# runc works; vfs storage and cgroupfs need no kernel or systemd support; events go to a
# file (no journald). No registry is reachable, so the test image is imported from the
# host's busybox-static. Containers must use host networking (no bridge here).
# CONTAINERS_REGISTRIES_CONF, when exported (scripts/registry.sh prints it: its test registry
# is plain HTTP, so marked insecure there), is inherited by the service and printed with the
# env; start the registry first, since a running service keeps the file it started with.
set -euo pipefail

TEST_IMAGE="localhost/heteroflow-test:busybox"

install=0
args=()
for a in "$@"; do
  case "$a" in
    --install) install=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
cmd="${args[0]:-}"
DIR="${args[1]:-${HETEROFLOW_ENGINE_DIR:-${TMPDIR:-/tmp}/heteroflow-container-engine}}"
case "$cmd" in start|stop|env|status) ;; *)
  echo "usage: $0 [--install] start|stop|env|status [DIR]" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
SOCK="$DIR/podman.sock"
CONF="$DIR/containers.conf"
PIDFILE="$DIR/podman.pid"
LOG="$DIR/service.log"
RUNROOT="$DIR/run"
if [ ${#RUNROOT} -gt 50 ]; then  # podman refuses a longer runroot
  RUNROOT="/tmp/hf-engine-$(printf %s "$DIR" | md5sum | cut -c1-12)"
fi
if [ ${#SOCK} -gt 100 ]; then
  echo "container-engine: $SOCK is too long for a Unix socket; use a shorter DIR" >&2; exit 1
fi

log() { echo "container-engine: $*" >&2; }

print_env() {
  echo "export DOCKER_HOST=unix://$SOCK"
  echo "export CONTAINERS_CONF=$CONF"
  echo "export HETEROFLOW_TEST_IMAGE=$TEST_IMAGE"
  if [ -n "${CONTAINERS_REGISTRIES_CONF:-}" ]; then echo "export CONTAINERS_REGISTRIES_CONF=$CONTAINERS_REGISTRIES_CONF"; fi
}

podman_cmd() {
  CONTAINERS_CONF="$CONF" podman \
    --root "$DIR/storage" --runroot "$RUNROOT" --tmpdir "$DIR/tmp" \
    --runtime runc --storage-driver vfs --cgroup-manager cgroupfs --events-backend file \
    "$@"
}

answers() {
  [ -S "$SOCK" ] || return 1
  command -v curl >/dev/null 2>&1 || { [ -n "$(service_pid)" ]; return; }
  [ "$(curl -s --max-time 3 --unix-socket "$SOCK" http://d/_ping 2>/dev/null)" = "OK" ]
}

service_pid() {
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # only a podman service on our socket: never kill an unrelated process that reused the pid
  if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "system service.*unix://$SOCK"; then
    echo "$pid"
  fi
}

write_conf() {
  mkdir -p "$DIR/storage" "$RUNROOT" "$DIR/tmp"
  cat >"$CONF" <<EOF
# Written by scripts/container-engine.sh: the sandbox lacks CAP_SYS_RESOURCE.
[containers]
default_ulimits = []
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$DIR/tmp/events.log"
EOF
}

install_missing() {
  local pkgs=()
  command -v podman >/dev/null 2>&1 || pkgs+=(podman)
  command -v runc >/dev/null 2>&1 || pkgs+=(runc)
  busybox_path >/dev/null || pkgs+=(busybox-static)
  [ ${#pkgs[@]} -eq 0 ] && return 0
  if [ "$install" != 1 ]; then
    log "missing: ${pkgs[*]} (run with --install as root, or apt-get install -y podman runc busybox-static)"
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

# A statically linked busybox (the image has no libc): busybox-static's, not busybox's.
busybox_path() {
  local candidate
  for candidate in /bin/busybox "$(command -v busybox 2>/dev/null || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && ! ldd "$candidate" >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

import_image() {
  if podman_cmd image exists "$TEST_IMAGE" 2>/dev/null; then
    return 0
  fi
  local bb root
  bb="$(busybox_path)" || { log "no statically linked busybox (apt-get install busybox-static)"; return 1; }
  root="$DIR/image-root"
  rm -rf "$root" "$DIR/image.tar"
  mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/proc" "$root/sys" "$root/dev" "$root/www"
  chmod 1777 "$root/tmp"
  cp "$bb" "$root/bin/busybox"
  # every applet (sh with trap, echo, sleep, cat, env, true, false, httpd, ls, kill, ...)
  local applet
  for applet in $("$root/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
  done
  for applet in sh echo sleep cat env true false httpd ls kill; do
    [ -e "$root/bin/$applet" ] || { log "busybox lacks applet $applet"; return 1; }
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
  echo 'root:x:0:' >"$root/etc/group"
  tar -C "$root" -cf "$DIR/image.tar" .
  podman_cmd import -q --change 'ENV PATH=/bin' --change 'CMD ["/bin/sh"]' \
    "$DIR/image.tar" "$TEST_IMAGE" >/dev/null
  rm -rf "$root" "$DIR/image.tar"
  log "imported $TEST_IMAGE"
}

# `setsid` cannot run a shell function, so spell the command out for the service.
launch_service() {
  cd /
  CONTAINERS_CONF="$CONF" setsid podman \
    --root "$DIR/storage" --runroot "$RUNROOT" --tmpdir "$DIR/tmp" \
    --runtime runc --storage-driver vfs --cgroup-manager cgroupfs --events-backend file \
    system service --time=0 "unix://$SOCK" </dev/null >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
}

cmd_start() {
  install_missing || exit 1
  write_conf
  if answers; then
    log "reusing the service on $SOCK"
    if [ -n "${CONTAINERS_REGISTRIES_CONF:-}" ] && [ -n "$(service_pid)" ] &&
      ! tr '\0' '\n' <"/proc/$(service_pid)/environ" | grep -qx "CONTAINERS_REGISTRIES_CONF=$CONTAINERS_REGISTRIES_CONF"; then
      log "warning: the running service was started without CONTAINERS_REGISTRIES_CONF=$CONTAINERS_REGISTRIES_CONF (stop and start it to pull from that registry)"
    fi
  else
    local old
    old="$(service_pid)"
    if [ -n "$old" ]; then kill "$old" 2>/dev/null || true; fi
    rm -f "$SOCK"
    log "starting podman system service on $SOCK (log: $LOG)"
    (launch_service)
    local i pid
    pid="$(cat "$PIDFILE")"
    for i in $(seq 1 100); do
      answers && break
      if ! kill -0 "$pid" 2>/dev/null; then
        log "the service exited; its log:"; tail -20 "$LOG" >&2
        exit 1
      fi
      sleep 0.2
    done
    if ! answers; then
      log "the service did not answer on $SOCK within 20 s; its log:"; tail -20 "$LOG" >&2
      exit 1
    fi
  fi
  import_image || exit 1
  print_env
}

cmd_stop() {
  local pid
  pid="$(service_pid)"
  if command -v podman >/dev/null 2>&1 && [ -d "$DIR/storage" ] && [ -f "$CONF" ]; then
    # the storage is this script's own: every container in it is a test leftover
    podman_cmd rm -af -t 0 >/dev/null 2>&1 || true
  fi
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "stopped the service (pid $pid)"
  fi
  rm -f "$SOCK" "$PIDFILE"
}

case "$cmd" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  env) print_env ;;
  status) answers ;;
esac
