#!/usr/bin/env bash
# HeteroFlow node agent forced update, served by the control plane at @@SERVER_URL@@
#
#   curl -fsSL @@SERVER_URL@@@@AGENT_PATH@@/update-agent-force.sh | sudo bash
#
# Brings a node to exactly the control plane's build, whatever state it is in: builds a
# fresh virtual environment with everything reinstalled from the control plane's
# verified files, stops the agent, wipes every older virtual environment, rewrites the
# systemd unit and starts the agent again. The configuration
# (/etc/heteroflow-agent/agent-config.json) is kept; its key is checked first.
set -euo pipefail

@@COMMON@@

usage() {
    cat <<EOF
Forced update of the HeteroFlow node agent from $HF_SERVER_URL: fresh virtual environment, restart.

  curl -fsSL $HF_SERVER_URL$HF_AGENT_PATH/update-agent-force.sh | sudo bash [-s -- options]

  --server URL      download from this control plane (default: $HF_SERVER_URL;
                    the configured server_url is not changed)
  --arch ARCH       $HF_ARCHES (default: from uname -m)
  --python PATH     the Python to build the virtual environment from (default python3)
  --root DIR        the installation below DIR (as given to install.sh --root; no systemctl)
  --no-start        update, but do not start the agent again
  -h, --help        this text
EOF
}

main() {
    local key option value
    while [ $# -gt 0 ]; do
        case "$1" in
        --*=*)
            option=${1%%=*} value=${1#*=}
            shift
            set -- "$option" "$value" "$@"
            ;;
        esac
        case "$1" in
        --server) hf_need "$@"; SERVER=$2; shift 2 ;;
        --arch) hf_need "$@"; ARCH=$2; shift 2 ;;
        --root) hf_need "$@"; ROOT=$2; shift 2 ;;
        --python) hf_need "$@"; PYTHON=$2; shift 2 ;;
        --no-start) START=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
        esac
    done

    hf_init
    hf_require_tools
    [ -f "$CONFIG" ] || die "no agent is installed here ($CONFIG is missing): install it with install.sh"
    key=$(hf_config_value api_key) || die "$CONFIG has no api_key: re-run install.sh with --key"
    hf_check_key "$key"
    hf_fetch_dist

    hf_new_venv
    hf_stop_service
    hf_switch_venv
    hf_drop_old_venvs
    say "wiped the older virtual environments; $VENV -> ${NEW_VENV##*/}"
    mkdir -p "$DATA_DIR"
    hf_write_unit
    hf_start_service
    say "force-updated ($(hf_describe_build)); configuration kept"
}

main "$@"
