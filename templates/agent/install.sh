#!/usr/bin/env bash
# HeteroFlow node agent installer, served by the control plane at @@SERVER_URL@@
#
#   curl -fsSL @@SERVER_URL@@@@AGENT_PATH@@/install.sh | sudo bash -s -- --key AGENT_KEY
#
# 1. checks the key against the control plane (GET @@AGENT_PATH@@/auth-check) and stops on a
#    wrong one before writing anything;
# 2. downloads the agent and its dependency wheels for this machine's architecture from
#    the control plane (no PyPI access needed) and checks each against SHA256SUMS;
# 3. installs them into a new virtual environment, /opt/heteroflow-agent/venv;
# 4. writes /etc/heteroflow-agent/agent-config.json (mode 600) and the systemd unit
#    /etc/systemd/system/heteroflow-agent.service, then (re)starts the agent.
# Running it again upgrades in place and keeps node_id / heartbeat_interval unless given.
set -euo pipefail

@@COMMON@@

usage() {
    cat <<EOF
Install the HeteroFlow node agent from the control plane at $HF_SERVER_URL.

  curl -fsSL $HF_SERVER_URL$HF_AGENT_PATH/install.sh | sudo bash -s -- --key AGENT_KEY [options]

  --key KEY         the control plane's agent key (HETEROFLOW_AGENT_SECRET); required.
                    Or set HETEROFLOW_AGENT_KEY in the environment instead.
  --server URL      the control plane to use (default: $HF_SERVER_URL)
  --node-id ID      this node's id (default: the agent chooses; kept from an earlier install)
  --interval SEC    heartbeat interval, 5..300 seconds (default 5, or the one configured)
  --arch ARCH       $HF_ARCHES (default: from uname -m)
  --python PATH     the Python to build the virtual environment from (default python3;
                    $HF_MIN_PYTHON or newer)
  --root DIR        install below DIR instead of / (a trial or test install; no systemctl)
  --no-start        write everything and enable the unit, but do not start the agent
  -h, --help        this text
EOF
}

main() {
    local key=${HETEROFLOW_AGENT_KEY-} node_id="" interval="" option value
    while [ $# -gt 0 ]; do
        case "$1" in
        --*=*)
            option=${1%%=*} value=${1#*=}
            shift
            set -- "$option" "$value" "$@"
            ;;
        esac
        case "$1" in
        --key) hf_need "$@"; key=$2; shift 2 ;;
        --server) hf_need "$@"; SERVER=$2; shift 2 ;;
        --node-id) hf_need "$@"; node_id=$2; shift 2 ;;
        --interval) hf_need "$@"; interval=$2; shift 2 ;;
        --arch) hf_need "$@"; ARCH=$2; shift 2 ;;
        --python) hf_need "$@"; PYTHON=$2; shift 2 ;;
        --root) hf_need "$@"; ROOT=$2; shift 2 ;;
        --no-start) START=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
        esac
    done
    [ -n "$key" ] || { usage >&2; die "--key is required: the control plane's agent key (HETEROFLOW_AGENT_SECRET)"; }
    case "$key" in
    *[[:space:][:cntrl:]]*) die "--key must not contain spaces or control characters" ;;
    esac
    if [ -n "$node_id" ] && ! [[ "$node_id" =~ ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$ ]]; then
        die "--node-id: '$node_id' is not a node id (letters, digits and . _ : -, at most 128, starting with a letter or digit)"
    fi
    if [ -n "$interval" ]; then
        if ! [[ "$interval" =~ ^[0-9]{1,3}$ ]] || [ "$interval" -lt 5 ] || [ "$interval" -gt 300 ]; then
            die "--interval must be a whole number of seconds from 5 to 300 (got '$interval')"
        fi
    fi

    hf_init
    hf_require_tools
    hf_check_key "$key"
    hf_fetch_dist

    # Everything below writes; everything above only read and downloaded.
    hf_new_venv
    mkdir -p "$CONFIG_DIR" "$DATA_DIR"
    chmod 755 "$CONFIG_DIR"
    chmod 700 "$DATA_DIR"
    HF_KEY=$key HF_NODE_ID=$node_id HF_INTERVAL=$interval HF_SERVER=$SERVER HF_CFG=$CONFIG HF_DATA_DIR=$DATA_DIR \
        "$PYTHON" -c '
import json, os

path = os.environ["HF_CFG"]
config = {}
try:
    with open(path) as handle:
        old = json.load(handle)
    if isinstance(old, dict):
        config.update(old)
except (OSError, ValueError):
    pass
config["server_url"] = os.environ["HF_SERVER"]
config["api_key"] = os.environ["HF_KEY"]
interval = os.environ["HF_INTERVAL"] or config.get("heartbeat_interval")
config["heartbeat_interval"] = int(interval) if str(interval).isdigit() and 5 <= int(interval) <= 300 else 5
if os.environ["HF_NODE_ID"]:
    config["node_id"] = os.environ["HF_NODE_ID"]
config.setdefault("data_dir", os.environ["HF_DATA_DIR"])
temporary = path + ".tmp"
descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(descriptor, "w") as handle:
    os.fchmod(handle.fileno(), 0o600)
    json.dump(config, handle, indent=2, sort_keys=True)
    handle.write("\n")
os.replace(temporary, path)
' </dev/null || die "writing $CONFIG failed"
    say "wrote $CONFIG (mode 600)"
    hf_write_unit
    say "wrote $UNIT"
    hf_switch_venv
    hf_start_service
    hf_drop_old_venvs
    say "installed: $VENV -> ${NEW_VENV##*/}; the node registers itself with its first heartbeat"
}

main "$@"
