#!/usr/bin/env bash
# Real inference engines in the virtual environment (requirements/engines.txt): today
# llama.cpp's OpenAI-compatible server through llama-cpp-python[server], which the agent's
# process runtime launches and tests/faults/test_inference_engine.py runs for real.
#
#   bash scripts/engines.sh [--install]     # or: make engines [ENGINES_ARGS=--install]
#
# llama-cpp-python has no wheel on the registry for this platform: pip builds llama.cpp
# from its source distribution (cmake and a C++ compiler; 7 minutes on 2 idle cores, 19
# when they are busy).
# The wheel built is kept in a cache outside the repository and reused when present:
#   $HETEROFLOW_WHEEL_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/heteroflow/wheels
# so a fresh virtual environment (CI makes one per run) installs it in seconds. The build
# targets this machine's CPU (llama.cpp's GGML_NATIVE default): the cache is per machine,
# never shared. Delete the wheel to rebuild. VENV (default .venv) names the environment.
# --install: `apt-get install -y cmake g++` for what the build lacks, when running as root
# (CI); without it a missing tool is an error that names it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
WHEELS="${HETEROFLOW_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/heteroflow/wheels}"
REQUIREMENTS=requirements/engines.txt
install=0
for arg in "$@"; do
  case "$arg" in
    --install) install=1 ;;
    *) echo "engines: unknown argument $arg (usage: scripts/engines.sh [--install])" >&2; exit 2 ;;
  esac
done

# the pinned line: llama-cpp-python[server]==X.Y.Z
pin="$(grep -E '^llama-cpp-python(\[[a-z,]+\])?==' "$REQUIREMENTS" | head -1)"
version="${pin##*==}"
if [ -z "$version" ]; then
  echo "engines: no pinned llama-cpp-python in $REQUIREMENTS" >&2
  exit 1
fi
mkdir -p "$WHEELS"
if ! compgen -G "$WHEELS/llama_cpp_python-$version-*.whl" >/dev/null; then
  missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v c++ >/dev/null 2>&1 || missing+=(g++)
  if [ "${#missing[@]}" -gt 0 ] && [ "$install" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "engines: installing ${missing[*]} for the build" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >&2 || { apt-get update -qq >&2 && apt-get install -y -qq "${missing[@]}" >&2; }
    missing=()
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v c++ >/dev/null 2>&1 || missing+=(g++)
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "engines: building llama-cpp-python needs ${missing[*]} (apt-get install -y ${missing[*]}, or --install as root)" >&2
    exit 1
  fi
  echo "engines: building llama-cpp-python $version (llama.cpp from source, 7-20 min on 2 cores) into $WHEELS" >&2
  started=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "${PIP[@]}" wheel --quiet --no-deps --no-binary llama-cpp-python --wheel-dir "$WHEELS" \
    "llama-cpp-python==$version" >&2
  echo "engines: built in $(($(date +%s) - started)) s" >&2
else
  echo "engines: llama-cpp-python $version from the cached wheel in $WHEELS" >&2
fi
"${PIP[@]}" install --quiet --find-links "$WHEELS" -r "$REQUIREMENTS" >&2
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('engines: llama-cpp-python', llama_cpp.__version__, 'installed')" >&2
