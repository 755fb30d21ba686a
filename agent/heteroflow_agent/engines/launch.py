"""How an inference engine is launched for a task's `serving` ({"engine", "model",
"format", "source", "args"}): the launch table. Pure functions, no I/O except the
install probe (`installed_engines`), which only looks modules up (it imports nothing).

- The **process runtime** runs an engine as a Python module of the node's engine
  interpreter (`engine_python` in the agent config; the agent's own by default):
  llama.cpp through llama-cpp-python's OpenAI-compatible server (`python -m
  llama_cpp.server`), vLLM (`python -m vllm.entrypoints.openai.api_server`), SGLang
  (`python -m sglang.launch_server`). An engine counts as installed when its modules
  are found by that interpreter. MindIE has no such launch: it runs from its image only.
- The **container runtime** runs the router's image; containers share the host's
  network, so the engine listens on the task's host port directly. The argv is the
  image's own command line: the llama.cpp and vLLM images' entrypoint is the server,
  so the arguments alone; SGLang's image has no server entrypoint, so its module.

Every launch listens on 0.0.0.0:<host port> and answers clients under the name in
`serving.model` (the name the gateway and clients put in `"model"`), then the
operator's `serving.args` (engine arguments) are appended as given.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from heteroflow_agent.engines.names import ANY_VENDOR, LLAMACPP, SGLANG, VLLM

PROBE_TIMEOUT = 10.0  # seconds for another interpreter to answer the install probe (a beat waits for it)


@dataclass(frozen=True)
class ProcessEngine:
    module: str  # run as `python -m module`
    requires: tuple[str, ...]  # top-level modules that must be importable (the server's extras too)
    distribution: str  # the installed package whose version is reported
    model_flag: str
    alias_flag: str
    vendors: tuple[str, ...]  # where it runs (ANY_VENDOR: CPU included)
    # flags it gets before the operator's serving.args (which may override them: the
    # engine's parser keeps the last)
    defaults: tuple[str, ...] = ()


PROCESS_ENGINES: dict[str, ProcessEngine] = {
    LLAMACPP: ProcessEngine(
        module="llama_cpp.server",
        requires=("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"),
        distribution="llama_cpp_python",
        model_flag="--model",
        alias_flag="--model_alias",
        vendors=(ANY_VENDOR,),
        # its server stops a streaming answer whenever another request waits for the model
        # (interrupt_requests, on by default): a probe or a second client would cut a
        # user's stream short, with no finishing chunk
        defaults=("--interrupt_requests", "false"),
    ),
    VLLM: ProcessEngine(
        module="vllm.entrypoints.openai.api_server",
        requires=("vllm",),
        distribution="vllm",
        model_flag="--model",
        alias_flag="--served-model-name",
        vendors=("nvidia", "amd"),
    ),
    SGLANG: ProcessEngine(
        module="sglang.launch_server",
        requires=("sglang",),
        distribution="sglang",
        model_flag="--model-path",
        alias_flag="--served-model-name",
        vendors=("nvidia", "amd"),
    ),
}

# the router's image table for the process runtime: vendor -> engine -> "what runs it"
# (the module), so that route() picks among installed modules as it does among images
PROCESS_TABLE: dict[str, dict[str, str]] = {}
for _engine, _spec in PROCESS_ENGINES.items():
    for _vendor in _spec.vendors:
        PROCESS_TABLE.setdefault(_vendor, {})[_engine] = _spec.module

# container images: (argv before the model flag, model flag, alias flag)
CONTAINER_LAUNCH: dict[str, tuple[tuple[str, ...], str, str]] = {
    LLAMACPP: ((), "--model", "--alias"),  # ghcr.io/ggml-org/llama.cpp:server*: llama-server
    VLLM: ((), "--model", "--served-model-name"),  # vllm/vllm-openai: the API server
    SGLANG: (("python3", "-m", "sglang.launch_server"), "--model-path", "--served-model-name"),
}


class LaunchError(ValueError):
    """The task's serving cannot be turned into a launch; the message says why."""


def serving_of(task: Mapping) -> dict:
    """The task's serving block; a task from an older server (top-level `engine` and
    `model_format`, no `serving`) reads as one with only those two."""
    serving = task.get("serving")
    if isinstance(serving, Mapping) and serving:
        return dict(serving)
    if task.get("engine"):
        return {"engine": task.get("engine"), "format": task.get("model_format") or ""}
    return {}


def _engine_args(serving: Mapping) -> list[str]:
    args = serving.get("args") or []
    if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
        raise LaunchError(f"serving.args must be a list of strings, not {args!r}")
    return list(args)


def _common(serving: Mapping, host_port: int | None, model_flag: str, alias_flag: str) -> list[str]:
    source = serving.get("source")
    if not isinstance(source, str) or not source:
        raise LaunchError("serving.source is empty: the engine has no model to load")
    if not host_port:
        raise LaunchError("the task has no host port to serve on")
    argv = [model_flag, source, "--host", "0.0.0.0", "--port", str(int(host_port))]
    model = serving.get("model")
    if isinstance(model, str) and model:
        argv += [alias_flag, model]
    return argv + _engine_args(serving)


# each engine's flag for the share of the card's memory it may take (both runtimes); an
# engine without one (llama.cpp: llama-cpp-python's server has none) is bounded only by
# its slice's enforcement where the tier enforces it, and reads
# HETEROFLOW_GPU_MEMORY_FRACTION from its env
MEMORY_FRACTION_FLAGS: dict[str, str] = {
    VLLM: "--gpu-memory-utilization",
    SGLANG: "--mem-fraction-static",
}


def _operator_fraction(args: list, flag: str) -> tuple[int, int, float | None] | None:
    """Where the operator gave `flag` in `args`: (its position, how many items it takes,
    its value, None when it is not a number); None when it is not there."""
    for position, arg in enumerate(args):
        if arg == flag:
            value = args[position + 1] if position + 1 < len(args) else None
            return position, 2 if value is not None else 1, _number(value)
        if isinstance(arg, str) and arg.startswith(flag + "="):
            return position, 1, _number(arg[len(flag) + 1 :])
    return None


def _number(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def with_memory_fraction(engine: str, serving: Mapping, fraction: str | None) -> dict:
    """The serving block with the engine's memory-fraction flag (MEMORY_FRACTION_FLAGS)
    set to the slice's share of the card. The operator's own flag in serving.args stands
    when it is at most the share (or not a number: the engine says what is wrong with
    it); one above the share is lowered to it, since the share is all the engine has:
    beyond it an enforcing tier fails the engine's allocation and the software tier
    takes a neighbour's memory."""
    serving = dict(serving)
    flag = MEMORY_FRACTION_FLAGS.get(engine)
    if flag is None or not fraction:
        return serving
    args = serving.get("args") or []
    if not isinstance(args, list):
        return serving  # _engine_args reports it
    given = _operator_fraction(args, flag)
    if given is None:
        serving["args"] = [*args, flag, fraction]
        return serving
    position, width, value = given
    if value is None or value <= float(fraction):
        return serving
    serving["args"] = [*args[:position], *args[position + width :], flag, fraction]
    return serving


def process_argv(engine: str, python: str, serving: Mapping, host_port: int | None) -> list[str]:
    """The process runtime's command line for `engine` serving `serving` on `host_port`."""
    spec = PROCESS_ENGINES.get(engine)
    if spec is None:
        known = ", ".join(sorted(PROCESS_ENGINES))
        raise LaunchError(f"{engine} cannot run as a plain process (the process runtime runs {known})")
    return [python, "-m", spec.module, *spec.defaults, *_common(serving, host_port, spec.model_flag, spec.alias_flag)]


def container_argv(engine: str, serving: Mapping, host_port: int | None) -> list[str]:
    """The command of the router's image for `engine`; an engine whose image's command
    line is not known here gets the operator's args alone."""
    if engine not in CONTAINER_LAUNCH:
        return _engine_args(serving)
    prefix, model_flag, alias_flag = CONTAINER_LAUNCH[engine]
    return [*prefix, *_common(serving, host_port, model_flag, alias_flag)]


# --- the install probe ---------------------------------------------------------------------


def _find(wanted: dict) -> dict:
    """engine -> its package's version, for those whose modules this interpreter finds
    (looked up, not imported). Also run as-is by another interpreter (`_PROBE`)."""
    import importlib.metadata
    import importlib.util

    found = {}
    for engine, (requires, distribution) in wanted.items():
        if all(importlib.util.find_spec(name) is not None for name in requires):
            try:
                found[engine] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                found[engine] = "unknown"
    return found


_PROBE = inspect.getsource(_find) + "\nimport json, sys\nprint(json.dumps(_find(json.loads(sys.argv[1]))))\n"


def _wanted(engines: Iterable[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    return {e: (PROCESS_ENGINES[e].requires, PROCESS_ENGINES[e].distribution) for e in engines}


def installed_engines(python: str | None = None, engines: Iterable[str] | None = None) -> tuple[list[str], dict]:
    """(engines installed for the process runtime, engine -> package version): those
    whose modules `python` finds. The agent's own interpreter is asked in-process;
    another one through a short subprocess (a failure there counts as none)."""
    wanted = _wanted(engines if engines is not None else PROCESS_ENGINES)
    if not python or python == sys.executable:
        found = _find(wanted)
    else:
        try:
            answer = subprocess.run(
                [python, "-c", _PROBE, json.dumps(wanted)],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
                check=True,
            )
            found = json.loads(answer.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            found = {}
    return sorted(found), {engine: str(version)[:64] for engine, version in found.items()}
