#!/usr/bin/env bash
# HeteroFlow node agent quick update, served by the control plane at @@SERVER_URL@@
#
#   curl -fsSL @@SERVER_URL@@@@AGENT_PATH@@/update-agent-quick.sh | sudo bash
#
# Reinstalls the agent package (and brings its dependencies to the pinned versions) in
# the existing virtual environment from the control plane's verified files, then
# restarts the agent. The configuration (/etc/heteroflow-agent/agent-config.json) is
# kept as it is; its key is checked against the control plane first. Task containers
# keep running across the restart. For a clean slate use update-agent-force.sh.
set -euo pipefail

@@COMMON@@

usage() {
    cat <<EOF
Quick update of the HeteroFlow node agent from $HF_SERVER_URL: reinstall the package, restart.

  curl -fsSL $HF_SERVER_URL$HF_AGENT_PATH/update-agent-quick.sh | sudo bash [-s -- options]

  --server URL      download from this control plane (default: $HF_SERVER_URL;
                    the configured server_url is not changed)
  --arch ARCH       $HF_ARCHES (default: from uname -m)
  --root DIR        the installation below DIR (as given to install.sh --root; no systemctl)
  --no-start        update, but do not restart the agent
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
    [ -x "$VENV/bin/python" ] ||
        die "the agent's virtual environment ($VENV) is missing or broken: use update-agent-force.sh"
    key=$(hf_config_value api_key) || die "$CONFIG has no api_key: re-run install.sh with --key"
    hf_check_key "$key"
    hf_fetch_dist

    say "reinstalling the agent in $VENV"
    hf_pip "$VENV" install --force-reinstall --no-deps "$HF_DL/$AGENT_WHEEL" ||
        die "reinstalling the agent failed (pip's message above); the agent was not restarted"
    hf_pip "$VENV" install "$HF_DL/$AGENT_WHEEL" ||
        die "bringing the agent's dependencies up to date failed (pip's message above); the agent was not restarted"
    mkdir -p "$DATA_DIR"
    hf_write_unit
    hf_start_service
    say "updated ($(hf_describe_build)); configuration kept"
}

main "$@"
