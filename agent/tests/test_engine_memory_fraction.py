"""A memory-share replica's engine is told its share of the card (launch.MEMORY_FRACTION_FLAGS:
vLLM's --gpu-memory-utilization, SGLang's --mem-fraction-static), on both runtimes; the
operator's own flag at or below the share stands, one above it is lowered to it; an
engine without the flag (llama.cpp) and a MIG slice (the card it sees is its own) get none."""

from __future__ import annotations

import pytest

from heteroflow_agent.engines.launch import MEMORY_FRACTION_FLAGS, with_memory_fraction
from heteroflow_agent.engines.router import LLAMACPP, SGLANG, VLLM, Route
from heteroflow_agent.task_spec import with_engine

SHARE = {  # 20,000 MB of an 80,000 MB card: "0.250"
    "id": 41,
    "tier": "mps",
    "state": "confirmed",
    "gpu_index": 0,
    "memory_mb": 20000,
    "memory_total_mb": 80000,
}


def replica(engine: str, args: list[str], slice_: dict | None = SHARE) -> dict:
    return {
        "id": 7,
        "name": "small-0",
        "kind": "inference",
        "image": "auto",
        "command": [],
        "gpu_required": 0,
        "gpu_memory_mb": 20000,
        "host_port": 8001,
        "slice": slice_,
        "serving": {"engine": engine, "model": "qwen3-0.6b", "format": "safetensors", "source": "/m/q", "args": args},
    }


def argv(engine: str, args: list[str], *, runtime: str = "process", slice_: dict | None = SHARE) -> list[str]:
    route = Route(engine, f"{engine}-image", "installed")
    return with_engine(replica(engine, args, slice_), route, runtime_kind=runtime, engine_python="py")["command"]


def value_of(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == flag] + [
        arg.split("=", 1)[1] for arg in command if arg.startswith(flag + "=")
    ]


@pytest.mark.parametrize("runtime", ["process", "docker"])
@pytest.mark.parametrize("engine,flag", [(VLLM, "--gpu-memory-utilization"), (SGLANG, "--mem-fraction-static")])
def test_the_engine_gets_its_share_of_the_card(runtime, engine, flag):
    command = argv(engine, ["--max-model-len", "4096"], runtime=runtime)
    assert value_of(command, flag) == ["0.250"]
    assert command[command.index("--max-model-len") + 1] == "4096"
    assert command[command.index("--port") + 1] == "8001"
    # the other engine's flag is never given to it
    other = next(f for e, f in MEMORY_FRACTION_FLAGS.items() if e != engine)
    assert other not in " ".join(command)


@pytest.mark.parametrize("engine", [VLLM, SGLANG])
@pytest.mark.parametrize("given", [["{flag}", "0.2"], ["{flag}=0.2"], ["{flag}", "0.250"], ["{flag}", "lots"]])
def test_the_operators_fraction_within_the_share_stands(engine, given):
    flag = MEMORY_FRACTION_FLAGS[engine]
    args = ["-x", *(arg.format(flag=flag) for arg in given)]
    command = argv(engine, args)
    assert command[-len(args) :] == args  # as given, nothing appended or replaced


@pytest.mark.parametrize("engine", [VLLM, SGLANG])
@pytest.mark.parametrize("given", [["{flag}", "0.9"], ["{flag}=0.9"]])
def test_an_operators_fraction_above_the_share_is_lowered_to_it(engine, given):
    flag = MEMORY_FRACTION_FLAGS[engine]
    command = argv(engine, ["-x", *(arg.format(flag=flag) for arg in given), "-y"])
    assert value_of(command, flag) == ["0.250"]
    assert command[-4:] == ["-x", "-y", flag, "0.250"]


def test_llama_cpp_has_no_fraction_flag_and_a_mig_slice_needs_none():
    assert LLAMACPP not in MEMORY_FRACTION_FLAGS
    assert argv(LLAMACPP, ["-x"])[-1] == "-x"
    mig = dict(SHARE, tier="mig", device_id="MIG-1")
    assert not value_of(argv(VLLM, [], slice_=mig), "--gpu-memory-utilization")
    # whole cards (no slice) and a card whose total is unknown: no flag either
    assert not value_of(argv(SGLANG, [], slice_=None), "--mem-fraction-static")
    unknown = dict(SHARE, memory_total_mb=None)
    assert not value_of(argv(SGLANG, [], slice_=unknown), "--mem-fraction-static")


def test_a_fraction_is_not_added_to_args_that_are_not_a_list():
    serving = {"engine": VLLM, "args": "--gpu-memory-utilization 0.9"}
    assert with_memory_fraction(VLLM, serving, "0.250") == serving
