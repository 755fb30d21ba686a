# ---- shared by install.sh and the update scripts (templates/agent/common.sh) ----------
# The control plane fills these in when it serves the script.
HF_SERVER_URL='@@SERVER_URL@@'
HF_AGENT_PATH='@@AGENT_PATH@@'
HF_MIN_PYTHON='@@MIN_PYTHON@@'
HF_ARCHES='@@ARCHES@@'
HF_SCRIPT='@@SCRIPT_NAME@@'
HF_UNIT_NAME='heteroflow-agent.service'
# systemd gives services a PATH without /usr/lib/wsl/lib, where WSL2 keeps nvidia-smi and
# the GPU libraries: without it a WSL2 node's GPUs would not be found.
HF_UNIT_PATH='/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/lib/wsl/lib:/usr/local/nvidia/bin:/usr/local/cuda/bin'

# Set by the scripts' option parsing; read by the functions below.
ROOT=""
PYTHON="python3"
ARCH=""
SERVER="$HF_SERVER_URL"
START=1

say() { printf 'heteroflow-agent: %s\n' "$*"; }
warn() { printf 'heteroflow-agent: WARNING: %s\n' "$*" >&2; }
die() {
    printf 'heteroflow-agent: ERROR: %s\n' "$*" >&2
    exit 1
}

# hf_need OPTION [VALUE]: dies unless the option was given a value.
hf_need() {
    if [ $# -lt 2 ] || [ -z "$2" ]; then
        die "$1 needs a value (see --help)"
    fi
}

hf_normalize_arch() {
    case "$1" in
    x86_64 | amd64 | x64) printf 'x86_64' ;;
    aarch64 | arm64) printf 'aarch64' ;;
    *) printf '%s' "$1" ;;
    esac
}

# hf_init: checks the common options, sets the paths, a clean environment for pip and
# a temporary folder (removed on exit). Writes nothing outside that temporary folder.
hf_init() {
    if [ -n "$ROOT" ]; then
        case "$ROOT" in
        /*) ;;
        *) die "--root needs an absolute path (got '$ROOT')" ;;
        esac
        case "$ROOT" in
        *[[:space:]]*) die "--root must not contain spaces" ;;
        esac
        ROOT=${ROOT%/}
    elif [ "$(id -u)" != 0 ]; then
        die "run as root (curl -fsSL $HF_SERVER_URL$HF_AGENT_PATH/$HF_SCRIPT | sudo bash -s -- ...), or pass --root DIR for a trial install into a scratch folder"
    fi
    SERVER=${SERVER%/}
    case "$SERVER" in
    http://?* | https://?*) ;;
    *) die "--server must be an http:// or https:// URL (got '$SERVER')" ;;
    esac
    case "$SERVER" in
    *[[:space:]\'\"\\]*) die "--server must not contain spaces or quotes" ;;
    esac
    local machine
    machine=$(uname -m)
    if [ -z "$ARCH" ]; then
        ARCH=$(hf_normalize_arch "$machine")
    else
        ARCH=$(hf_normalize_arch "$ARCH")
        if [ "$ARCH" != "$(hf_normalize_arch "$machine")" ]; then
            warn "--arch $ARCH differs from this machine ($machine)"
        fi
    fi
    case "$ARCH" in
    *[!A-Za-z0-9_]* | '') die "--arch: '$ARCH' is not an architecture name" ;;
    esac

    # Installs use only the files downloaded from the control plane: no pip
    # configuration, index, constraint or user site of this machine takes part.
    local name
    for name in $(compgen -e); do
        case "$name" in
        PIP_*) unset "$name" ;;
        esac
    done
    unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE
    export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONNOUSERSITE=1
    umask 022

    AGENT_HOME="$ROOT/opt/heteroflow-agent"
    VENVS="$AGENT_HOME/venvs"
    VENV="$AGENT_HOME/venv"
    CONFIG_DIR="$ROOT/etc/heteroflow-agent"
    CONFIG="$CONFIG_DIR/agent-config.json"
    DATA_DIR="$ROOT/var/lib/heteroflow-agent"
    UNIT_DIR="$ROOT/etc/systemd/system"
    UNIT="$UNIT_DIR/$HF_UNIT_NAME"

    HF_TMP=$(mktemp -d "${TMPDIR:-/tmp}/heteroflow-agent.XXXXXX") || die "cannot create a temporary folder"
    # shellcheck disable=SC2064
    trap "rm -rf '$HF_TMP'" EXIT
}

# hf_require_tools: curl, sha256sum and a Python new enough for the served wheels.
hf_require_tools() {
    command -v curl >/dev/null 2>&1 || die "curl is needed (apt-get install curl)"
    command -v sha256sum >/dev/null 2>&1 || die "sha256sum is needed (coreutils)"
    command -v "$PYTHON" >/dev/null 2>&1 ||
        die "$PYTHON not found: install Python $HF_MIN_PYTHON or newer (apt-get install python3), or pass --python PATH"
    PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null) ||
        die "$PYTHON does not run"
    "$PYTHON" -c 'import sys, venv; want = tuple(int(p) for p in sys.argv[1].split(".")); sys.exit(sys.version_info[:2] < want)' \
        "$HF_MIN_PYTHON" </dev/null ||
        die "$PYTHON is Python $PYVER; the agent needs $HF_MIN_PYTHON or newer (with its venv module). Install one, or pass --python PATH"
}

# hf_get URL FILE [KEY]: GET into FILE; sets HF_STATUS (000 when the server could not
# be reached). The key goes in a header read from stdin, never on curl's command line.
hf_get() {
    local url=$1 out=$2 key=${3-}
    if [ -n "$key" ]; then
        HF_STATUS=$(printf 'X-API-Key: %s\n' "$key" |
            curl -sS --connect-timeout 10 --max-time 60 -H @- -o "$out" -w '%{http_code}' "$url") || HF_STATUS=000
    else
        HF_STATUS=$(curl -sS -L --connect-timeout 10 --max-time 600 -o "$out" -w '%{http_code}' "$url" </dev/null) ||
            HF_STATUS=000
    fi
}

# hf_server_message FILE: the message of a {"error": {...}} answer, else the text itself.
hf_server_message() {
    [ -s "$1" ] || return 0
    "$PYTHON" -c '
import json, sys
try:
    print(json.load(open(sys.argv[1]))["error"]["message"])
except Exception:
    sys.exit(1)
' "$1" </dev/null 2>/dev/null || head -c 2000 "$1"
}

# hf_check_key KEY: asks the control plane whether KEY is its agent key. Stops here on
# a wrong key: an agent with it would be refused on every beat and never come online.
hf_check_key() {
    local body="$HF_TMP/auth-check.json"
    hf_get "$SERVER$HF_AGENT_PATH/auth-check" "$body" "$1"
    case "$HF_STATUS" in
    200) say "key accepted by $SERVER" ;;
    401)
        die "the key does not match this control plane; the agent would never come online." \
            "($SERVER$HF_AGENT_PATH/auth-check answered 401 to it.) Use the control plane's" \
            "HETEROFLOW_AGENT_SECRET. Nothing was installed."
        ;;
    403)
        die "that is a person's key, not the agents' key; the agent would never come online." \
            "Use the control plane's HETEROFLOW_AGENT_SECRET. Nothing was installed."
        ;;
    000) die "cannot reach the control plane at $SERVER (curl's message above). Nothing was installed." ;;
    404) die "$SERVER has no $HF_AGENT_PATH/auth-check: is it a HeteroFlow control plane, and --server right? Nothing was installed." ;;
    *) die "$SERVER answered HTTP $HF_STATUS to the key check: $(hf_server_message "$body") Nothing was installed." ;;
    esac
}

# hf_fetch_dist: downloads the set for $ARCH listed in its SHA256SUMS into $HF_DL and
# checks every file against it. Sets AGENT_WHEEL and PIP_WHEEL.
hf_fetch_dist() {
    local base="$SERVER$HF_AGENT_PATH/dist/$ARCH" sum name count=0 failed
    AGENT_WHEEL="" PIP_WHEEL=""
    HF_DL="$HF_TMP/dist"
    mkdir -p "$HF_DL"
    hf_get "$base/SHA256SUMS" "$HF_DL/SHA256SUMS"
    case "$HF_STATUS" in
    200) ;;
    404) die "no agent build for $ARCH on $SERVER: $(hf_server_message "$HF_DL/SHA256SUMS") Nothing was installed." ;;
    000) die "cannot reach $SERVER (curl's message above). Nothing was installed." ;;
    *) die "$base/SHA256SUMS answered HTTP $HF_STATUS: $(hf_server_message "$HF_DL/SHA256SUMS") Nothing was installed." ;;
    esac
    while read -r sum name; do
        [ -n "$sum" ] || continue
        name=${name#\*}
        case "$sum" in
        *[!0-9a-f]*) die "SHA256SUMS from $SERVER is malformed (line '$sum $name')" ;;
        esac
        [ ${#sum} -eq 64 ] || die "SHA256SUMS from $SERVER is malformed (line '$sum $name')"
        case "$name" in
        '' | SHA256SUMS | .* | *[!A-Za-z0-9._+-]*) die "SHA256SUMS from $SERVER names an unexpected file '$name'" ;;
        esac
        hf_get "$base/$name" "$HF_DL/$name"
        [ "$HF_STATUS" = 200 ] ||
            die "downloading $base/$name answered HTTP $HF_STATUS: $(hf_server_message "$HF_DL/$name") Nothing was installed."
        count=$((count + 1))
        case "$name" in
        heteroflow_agent-*.whl) AGENT_WHEEL=$name ;;
        pip-*.whl) PIP_WHEEL=$name ;;
        esac
    done <"$HF_DL/SHA256SUMS"
    [ "$count" -gt 0 ] || die "SHA256SUMS from $SERVER lists no files. Nothing was installed."
    if ! failed=$(cd "$HF_DL" && sha256sum --check --strict --quiet SHA256SUMS 2>&1); then
        die "checksum mismatch: $(printf '%s' "$failed" | tr '\n' ';') A downloaded file does not match the" \
            "control plane's SHA256SUMS (corrupted or tampered with). Nothing was installed."
    fi
    [ -n "$AGENT_WHEEL" ] || die "the $ARCH build on $SERVER holds no heteroflow_agent wheel. Nothing was installed."
    [ -n "$PIP_WHEEL" ] || die "the $ARCH build on $SERVER holds no pip wheel. Nothing was installed."
    say "downloaded and verified $count files for $ARCH ($(hf_describe_build))"
}

hf_describe_build() {
    "$PYTHON" -c '
import json, sys
try:
    agent = json.load(open(sys.argv[1]))["agent"]
    print("agent %s, commit %s, built %s" % (agent["version"], agent["git_commit"], agent["build_time"]))
except Exception:
    print(sys.argv[2])
' "$HF_DL/manifest.json" "$AGENT_WHEEL" </dev/null
}

# hf_pip VENV COMMAND ARGS...: the downloaded pip, run inside VENV, offline: only the
# verified files in $HF_DL are used.
hf_pip() {
    local venv=$1 command=$2
    shift 2
    "$venv/bin/python" "$HF_DL/$PIP_WHEEL/pip" "$command" --no-index --find-links "$HF_DL" --no-cache-dir \
        --disable-pip-version-check --no-input --quiet "$@" </dev/null
}

# hf_new_venv: a fresh virtual environment with pip and the agent in it (NEW_VENV).
# Nothing already installed is touched; a failure removes the half-made one.
hf_new_venv() {
    mkdir -p "$VENVS"
    NEW_VENV="$VENVS/$(date -u +%Y%m%dT%H%M%SZ)-$$"
    say "creating $NEW_VENV (Python $PYVER) and installing the agent offline from the verified files"
    # --without-pip: Debian and Ubuntu ship ensurepip separately (python3-venv); the
    # pip wheel from the control plane installs pip instead.
    "$PYTHON" -m venv --without-pip "$NEW_VENV" </dev/null || {
        rm -rf "$NEW_VENV"
        die "$PYTHON -m venv failed"
    }
    hf_pip "$NEW_VENV" install pip "$HF_DL/$AGENT_WHEEL" || {
        rm -rf "$NEW_VENV"
        die "installing the agent into a new virtual environment failed (pip's message above); the current installation is untouched"
    }
    [ -x "$NEW_VENV/bin/heteroflow-agent" ] || {
        rm -rf "$NEW_VENV"
        die "the agent wheel installed no heteroflow-agent command"
    }
}

# hf_switch_venv: points $VENV at NEW_VENV (atomically: a symlink swap).
hf_switch_venv() {
    if [ -e "$VENV" ] && [ ! -L "$VENV" ]; then
        rm -rf "$VENV" # a plain folder left by an older or manual installation
    fi
    rm -f "$AGENT_HOME/.venv.new"
    ln -s "venvs/${NEW_VENV##*/}" "$AGENT_HOME/.venv.new"
    mv -Tf "$AGENT_HOME/.venv.new" "$VENV"
}

# hf_drop_old_venvs: removes every virtual environment but the current one.
hf_drop_old_venvs() {
    local dir
    for dir in "$VENVS"/*; do
        [ -e "$dir" ] || continue
        [ "$dir" = "$NEW_VENV" ] || rm -rf "$dir"
    done
}

hf_config_value() {
    "$PYTHON" -c '
import json, sys
value = json.load(open(sys.argv[1])).get(sys.argv[2])
if not isinstance(value, (str, int)) or value == "":
    sys.exit(1)
print(value)
' "$CONFIG" "$1" </dev/null
}

hf_write_unit() {
    mkdir -p "$UNIT_DIR"
    cat >"$UNIT.tmp" <<EOF
# Written by the HeteroFlow agent installer ($HF_SCRIPT from $SERVER).
# Re-running the installer or an update script rewrites it; put local changes in
# /etc/systemd/system/$HF_UNIT_NAME.d/*.conf instead.
[Unit]
Description=HeteroFlow node agent
After=network-online.target docker.service
Wants=network-online.target

[Service]
Type=simple
Environment=PATH=$HF_UNIT_PATH
Environment=HETEROFLOW_AGENT_CONFIG=$CONFIG
Environment=PYTHONUNBUFFERED=1
ExecStart=$VENV/bin/heteroflow-agent
WorkingDirectory=$DATA_DIR
Restart=always
RestartSec=5
KillSignal=SIGTERM
# only the agent: tasks run by the process runtime live in the agent's cgroup and must
# outlive a restart or an upgrade of the agent (the next agent adopts them)
KillMode=process
TimeoutStopSec=30
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
    chmod 644 "$UNIT.tmp"
    mv -f "$UNIT.tmp" "$UNIT"
}

hf_systemd() { [ -z "$ROOT" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; }

hf_stop_service() {
    if hf_systemd && systemctl is-active --quiet "$HF_UNIT_NAME"; then
        say "stopping $HF_UNIT_NAME"
        systemctl stop "$HF_UNIT_NAME" || warn "systemctl stop $HF_UNIT_NAME failed"
    fi
}

# hf_start_service: reload systemd, enable the unit and (unless --no-start) restart it.
hf_start_service() {
    if [ -n "$ROOT" ]; then
        say "--root: systemctl skipped (unit written to $UNIT)"
        return 0
    fi
    if ! hf_systemd; then
        warn "systemd is not running here, so the agent was not started. Start it with:" \
            "HETEROFLOW_AGENT_CONFIG=$CONFIG $VENV/bin/heteroflow-agent"
        return 0
    fi
    systemctl daemon-reload
    systemctl enable "$HF_UNIT_NAME" >/dev/null 2>&1 || warn "systemctl enable $HF_UNIT_NAME failed"
    if [ "$START" != 1 ]; then
        say "not started (--no-start); start it with: systemctl start $HF_UNIT_NAME"
        return 0
    fi
    systemctl restart "$HF_UNIT_NAME" || die "systemctl restart $HF_UNIT_NAME failed (journalctl -u $HF_UNIT_NAME)"
    sleep 3
    if systemctl is-active --quiet "$HF_UNIT_NAME"; then
        say "$HF_UNIT_NAME is running; follow it with: journalctl -u $HF_UNIT_NAME -f"
    else
        warn "$HF_UNIT_NAME is not running yet; its last log lines:"
        journalctl -u "$HF_UNIT_NAME" -n 20 --no-pager >&2 || true
    fi
}
# ---- end of the shared part ---------------------------------------------------------
