"""The engine router: every vendor x format, the operator's priorities and images, an
explicit engine, and the probe's latest result read each time (never frozen)."""

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import EngineState
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.engines.router import (
    LLAMACPP,
    MINDIE,
    ROUTED_ENGINES,
    SGLANG,
    VENDORS_WITHOUT_IMAGES,
    VLLM,
    EngineRouter,
    image_table,
    route,
)
from heteroflow_agent.executor import Executor
from heteroflow_agent.heartbeat import ENGINES_EVERY, Heartbeat
from heteroflow_agent.inventory import engines_from_tags

FORMATS = ("safetensors", "pytorch", "hf", "gguf", "om", "onnx")
LLAMA_IMAGE = "ghcr.io/ggml-org/llama.cpp:latest"
# what each vendor serves when every engine the router knows is on the node
EXPECTED = {
    "nvidia": {
        "safetensors": (VLLM, "vllm/vllm-openai:latest"),
        "pytorch": (VLLM, "vllm/vllm-openai:latest"),
        "hf": (VLLM, "vllm/vllm-openai:latest"),
        "gguf": (LLAMACPP, LLAMA_IMAGE),
    },
    "amd": {
        "safetensors": (VLLM, "rocm/vllm:latest"),
        "pytorch": (VLLM, "rocm/vllm:latest"),
        "hf": (VLLM, "rocm/vllm:latest"),
        "gguf": (LLAMACPP, LLAMA_IMAGE),
    },
    "ascend": {
        "safetensors": (MINDIE, "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie:latest"),
        "om": (MINDIE, "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie:latest"),
        "gguf": (LLAMACPP, LLAMA_IMAGE),
    },
    **{vendor: {"gguf": (LLAMACPP, LLAMA_IMAGE)} for vendor in VENDORS_WITHOUT_IMAGES},
    "virtual": {"gguf": (LLAMACPP, LLAMA_IMAGE)},
}


@pytest.mark.parametrize("model_format", FORMATS)
@pytest.mark.parametrize("vendor", sorted(EXPECTED))
def test_every_vendor_and_format_routes_to_its_engine_or_says_why_not(vendor, model_format):
    chosen = route(vendor, ROUTED_ENGINES, model_format)
    expected = EXPECTED[vendor].get(model_format)
    if expected:
        assert (chosen.engine, chosen.image) == expected and not chosen.refused
        assert chosen.engine in chosen.reason
    else:
        assert chosen.refused and chosen.image is None
        assert model_format in chosen.reason


@pytest.mark.parametrize("vendor", VENDORS_WITHOUT_IMAGES)
def test_a_vendor_with_no_known_image_is_refused_naming_the_key_to_set(vendor):
    chosen = route(vendor, ROUTED_ENGINES, "safetensors")
    assert chosen.refused
    assert f"no image of vllm is known for {vendor} (the spec names none; set engine_images.{vendor}.vllm)" in (
        chosen.reason
    )


def test_the_operator_can_give_a_vendor_an_image_and_take_one_away():
    table = image_table({"hygon": {VLLM: "registry.local/dcu/vllm"}, "nvidia": {VLLM: ""}})
    assert route("hygon", [VLLM], "safetensors", images=table).image == "registry.local/dcu/vllm:latest"
    # nvidia's vllm removed: sglang is next in the default order
    assert route("nvidia", [VLLM, SGLANG], "safetensors", images=table).engine == SGLANG


def test_a_cpu_node_serves_gguf_with_llama_cpp_only():
    assert route("virtual", [LLAMACPP], "gguf").engine == LLAMACPP
    refused = route(None, [VLLM], "safetensors")
    assert refused.refused and "vllm needs an accelerator and this node has none" in refused.reason


def test_no_engine_for_the_format_names_what_was_detected():
    refused = route("nvidia", [VLLM], "gguf")
    assert refused.reason.startswith("no engine on this node serves gguf: detected vllm only")
    assert "llama.cpp is not on this node (no local ghcr.io/ggml-org/llama.cpp image)" in refused.reason
    nothing = route("nvidia", [], "safetensors")
    assert nothing.reason.startswith("no engine on this node serves safetensors: detected none")


def test_priorities_replace_the_default_order_for_their_format_only():
    priorities = {"safetensors": [SGLANG, VLLM]}
    assert route("nvidia", [VLLM, SGLANG], "safetensors", priorities=priorities).engine == SGLANG
    assert route("nvidia", [VLLM], "safetensors", priorities=priorities).engine == VLLM  # first one detected
    assert route("nvidia", [VLLM, SGLANG], "pytorch", priorities=priorities).engine == VLLM  # default order
    only = route("nvidia", [VLLM], "safetensors", priorities={"safetensors": [SGLANG]})
    assert only.refused and "sglang is not on this node" in only.reason  # vllm is not the operator's choice


def test_a_priority_naming_an_engine_that_cannot_serve_the_format_is_skipped():
    chosen = route("nvidia", [VLLM, LLAMACPP], "gguf", priorities={"gguf": [VLLM, LLAMACPP]})
    assert chosen.engine == LLAMACPP


def test_an_explicit_engine_must_be_detected_and_serve_the_format():
    assert route("nvidia", [VLLM, SGLANG], "safetensors", requested=SGLANG).engine == SGLANG
    missing = route("nvidia", [VLLM], "safetensors", requested=SGLANG)
    assert missing.refused and missing.reason.startswith("sglang cannot serve safetensors here")
    assert "sglang is not on this node" in missing.reason
    wrong = route("nvidia", [VLLM, LLAMACPP], "gguf", requested=VLLM)
    assert wrong.refused and wrong.reason == "vllm does not serve gguf models"
    unknown = route("nvidia", [VLLM], "safetensors", requested="tensorrt-llm")
    assert unknown.refused and "'tensorrt-llm' is not one the router knows" in unknown.reason


def test_auto_is_the_default_and_any_case_is_accepted():
    assert route("NVIDIA", [VLLM], "SafeTensors", requested="AUTO").engine == VLLM
    chosen = route("nvidia", [VLLM], "safetensors")
    assert chosen.reason == "vllm on nvidia: first detected of vllm, sglang, mindie for safetensors"


def test_the_image_carries_the_tag_the_probe_found():
    assert route("nvidia", [VLLM], "safetensors", versions={VLLM: "v0.6.3"}).image == "vllm/vllm-openai:v0.6.3"


def test_the_probe_counts_a_routed_engine_only_through_the_nodes_vendor_image():
    tags = ["vllm/vllm-openai:v0.6.3", "rocm/vllm:rocm6.2", "172.29.0.1:5000/rocm/sgl-dev:latest"]
    assert engines_from_tags(tags, "amd") == ([VLLM], {VLLM: "rocm6.2"})
    assert engines_from_tags(tags, "nvidia") == ([VLLM], {VLLM: "v0.6.3"})
    assert engines_from_tags(tags, "hygon") == ([], {})  # no image known: nothing counts
    assert engines_from_tags(["ghcr.io/ggml-org/llama.cpp:server"], "virtual") == ([LLAMACPP], {LLAMACPP: "server"})
    configured = image_table({"hygon": {VLLM: "registry.local/dcu/vllm"}})
    assert engines_from_tags(["registry.local/dcu/vllm:24.04"], "hygon", configured) == ([VLLM], {VLLM: "24.04"})


def test_the_router_reads_the_latest_probe_each_time_it_is_asked():
    probe = {"result": ([VLLM], {VLLM: "v1"})}
    router = EngineRouter("nvidia", lambda: probe["result"])
    assert router.choose("gguf").refused
    probe["result"] = ([VLLM, LLAMACPP], {VLLM: "v1", LLAMACPP: "server-cuda"})
    assert router.choose("gguf").image == "ghcr.io/ggml-org/llama.cpp:server-cuda"
    probe["result"] = ([], {})
    assert router.choose("safetensors").refused


@dataclass
class Detection:
    vendor: str = "nvidia"
    gpus: list = field(default_factory=list)
    collect_failures: list = field(default_factory=list)
    collector_error: str = ""
    capabilities: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    is_container: bool = False


class Engine:
    def __init__(self, tags):
        self.tags = tags

    def state(self):
        return EngineState(True)

    def image_tags(self):
        return list(self.tags)


def test_an_engine_pulled_after_start_is_routed_to_after_the_next_probe(tmp_path):
    engine = Engine(["vllm/vllm-openai:v1"])
    config = AgentConfig(
        server_url="http://unused", api_key="k", node_id="n1", data_dir=Path(tmp_path), model_scan_dirs=(str(tmp_path),)
    )
    beat = Heartbeat(config, ServerClient("http://unused", "k"), detect_gpus=Detection, engine=engine)
    router = EngineRouter(lambda: "nvidia", lambda: beat.engines)
    beat.payload()  # the probe at start
    assert router.choose("gguf").refused
    engine.tags.append("ghcr.io/ggml-org/llama.cpp:server-cuda")  # the operator pulls it
    for _ in range(ENGINES_EVERY):
        beat.beats += 1
        beat.payload()
    assert router.choose("gguf").engine == LLAMACPP
    engine.tags.clear()  # and removes everything
    beat.beats += ENGINES_EVERY
    beat.payload()
    assert router.choose("gguf").refused and router.choose("safetensors").refused


def test_an_inference_task_asking_for_an_engine_gets_the_routed_image_or_fails_with_the_reason():
    probe = {"result": ([VLLM], {VLLM: "v1"})}
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=None, vendor="nvidia", workers=2)
    executor.router = EngineRouter("nvidia", lambda: probe["result"])
    task = {"id": 7, "kind": "inference", "engine": "auto", "model_format": "safetensors", "image": ""}
    assert executor.route(task).image == "vllm/vllm-openai:v1"
    assert executor.route({**task, "image": "my/own:image"}) is None  # a task naming its image keeps it
    assert executor.route({**task, "kind": "batch"}) is None
    outcome = executor.run({**task, "model_format": "gguf"}, threading.Event())
    assert outcome.status == "failed"
    assert "no engine on this node serves gguf: detected vllm only" in outcome.error_message
    executor.router = None
    assert executor.route(task).refused
    executor.close()
