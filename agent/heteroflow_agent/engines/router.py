"""The engine router: which inference engine, and which image of it, serves a model of
a given format on this node. A pure function of (the node's vendor, the engines the
latest probe found, the model's format, the operator's `engine_priorities`, the engine
asked for or `auto`), so it is never frozen on the start-up snapshot: `EngineRouter`
reads the probe's latest result every time it is asked.

The spec (001, engine probe) names the engines (vLLM, SGLang, llama.cpp, MindIE) and
says an engine counts only when its image is on the node under exactly its repository
name; it names no image per vendor. The defaults below are the engines' own public
repositories for NVIDIA, AMD (ROCm builds), Ascend (MindIE) and llama.cpp (any
machine, CPU included). For Hygon DCU, Moore Threads, Cambricon, Kunlun, Iluvatar,
MetaX, Enflame and Biren neither the spec nor this table names an image: the router
refuses, naming the `engine_images` key the operator sets to allow one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from heteroflow_agent.engines.launch import PROCESS_TABLE
from heteroflow_agent.engines.names import ANY_VENDOR, AUTO, LLAMACPP, MINDIE, ROUTED_ENGINES, SGLANG, VLLM

# vendor -> engine -> image repository. The one image table; `engine_images` in the
# agent config overrides it entry by entry (an empty string removes an entry).
DEFAULT_IMAGES: dict[str, dict[str, str]] = {
    "nvidia": {VLLM: "vllm/vllm-openai", SGLANG: "lmsysorg/sglang"},
    "amd": {VLLM: "rocm/vllm", SGLANG: "rocm/sgl-dev"},
    "ascend": {MINDIE: "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie"},
    ANY_VENDOR: {LLAMACPP: "ghcr.io/ggml-org/llama.cpp"},
}
# vendors the detector knows for which no image is known (the spec names none)
VENDORS_WITHOUT_IMAGES = ("hygon", "musa", "cambricon", "kunlun", "iluvatar", "metax", "enflame", "biren")
CPU_VENDORS = ("virtual", "")  # no accelerator found: only llama.cpp's CPU build applies

# the formats each engine loads (the scanner's names: a Hugging Face folder is "hf"
# when it has no weight file the scanner knows, "pytorch" for .bin/.pt weights)
ENGINE_FORMATS: dict[str, frozenset[str]] = {
    VLLM: frozenset({"safetensors", "pytorch", "hf"}),
    SGLANG: frozenset({"safetensors", "pytorch", "hf"}),
    MINDIE: frozenset({"om", "safetensors"}),
    LLAMACPP: frozenset({"gguf"}),
}
# format -> engines in the order tried; `engine_priorities` replaces a format's list
DEFAULT_PRIORITIES: dict[str, tuple[str, ...]] = {
    "safetensors": (VLLM, SGLANG, MINDIE),
    "pytorch": (VLLM, SGLANG),
    "hf": (VLLM, SGLANG),
    "om": (MINDIE,),
    "gguf": (LLAMACPP,),
}


@dataclass(frozen=True)
class Route:
    """The router's answer: an engine and its image, or a refusal; `reason` says why
    either way (it goes into the task's failure message or the log)."""

    engine: str | None
    image: str | None
    reason: str

    @property
    def refused(self) -> bool:
        return self.engine is None


def image_table(overrides: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, dict[str, str]]:
    """DEFAULT_IMAGES with the operator's `engine_images` over it, entry by entry."""
    table = {vendor: dict(engines) for vendor, engines in DEFAULT_IMAGES.items()}
    for vendor, engines in (overrides or {}).items():
        for engine, repository in engines.items():
            if repository:
                table.setdefault(vendor, {})[engine] = repository
            else:
                table.get(vendor, {}).pop(engine, None)
    return table


def image_for(vendor: str, engine: str, table: Mapping[str, Mapping[str, str]]) -> str | None:
    """The image repository of `engine` for `vendor`: the vendor's own entry, else the
    any-vendor one (llama.cpp)."""
    return (table.get(vendor) or {}).get(engine) or (table.get(ANY_VENDOR) or {}).get(engine)


def repositories_for(vendor: str | None, table: Mapping[str, Mapping[str, str]]) -> dict[str, tuple[str, ...]]:
    """engine -> the repositories that make it available on `vendor` (None: on any
    vendor), for the probe's exact-name match."""
    found: dict[str, list[str]] = {}
    for owner, engines in table.items():
        if vendor is None or owner in (vendor, ANY_VENDOR):
            for engine, repository in engines.items():
                found.setdefault(engine, [])
                if repository not in found[engine]:
                    found[engine].append(repository)
    return {engine: tuple(repositories) for engine, repositories in found.items()}


def route(
    vendor: str | None,
    detected: Iterable[str],
    model_format: str,
    *,
    priorities: Mapping[str, Iterable[str]] | None = None,
    requested: str = AUTO,
    images: Mapping[str, Mapping[str, str]] | None = None,
    versions: Mapping[str, str] | None = None,
    absent: str = "no local {} image",
) -> Route:
    """Choose the engine and image for a model of `model_format` on this node.

    detected: the engines the latest probe found (their image is on the node);
    priorities: the operator's `engine_priorities` (format -> engines, replacing the
    default order for that format); requested: an engine name, or `auto`; images: the
    image table (image_table()); versions: engine -> the tag the probe found, used as
    the image's tag ("latest" when unknown); absent: why a repository of the table
    that the probe did not find is missing (the process runtime's table names
    modules, not images)."""
    vendor = (vendor or "").lower()
    model_format = (model_format or "").lower()
    requested = (requested or AUTO).lower()
    detected = sorted(set(detected))
    table = images if images is not None else image_table()
    versions = versions or {}
    on_cpu = vendor in CPU_VENDORS
    shown = ", ".join(detected) + " only" if detected else "none"

    order = list((priorities or {}).get(model_format) or DEFAULT_PRIORITIES.get(model_format, ()))
    if requested != AUTO:
        if requested not in ENGINE_FORMATS:
            return Route(None, None, f"engine {requested!r} is not one the router knows ({', '.join(ROUTED_ENGINES)})")
        if model_format not in ENGINE_FORMATS[requested]:
            return Route(None, None, f"{requested} does not serve {model_format or 'an unknown format'} models")
        order = [requested]
    if not order:
        return Route(None, None, f"no engine serves {model_format or 'an unknown format'} models (detected {shown})")

    why_not: list[str] = []
    for engine in order:
        if engine not in ENGINE_FORMATS or model_format not in ENGINE_FORMATS[engine]:
            why_not.append(f"{engine} does not serve {model_format}")
            continue
        if on_cpu and engine != LLAMACPP:
            why_not.append(f"{engine} needs an accelerator and this node has none")
            continue
        repository = image_for(vendor, engine, table)
        if not repository:
            key = f"engine_images.{vendor}.{engine}"
            why_not.append(f"no image of {engine} is known for {vendor} (the spec names none; set {key})")
            continue
        if engine not in detected:
            why_not.append(f"{engine} is not on this node ({absent.format(repository)})")
            continue
        tag = versions.get(engine) or "latest"
        source = "asked for" if requested != AUTO else f"first detected of {', '.join(order)} for {model_format}"
        return Route(engine, f"{repository}:{tag}", f"{engine} on {vendor or 'cpu'}: {source}")
    head = (
        f"{requested} cannot serve {model_format} here"
        if requested != AUTO
        else f"no engine on this node serves {model_format}: detected {shown}"
    )
    return Route(None, None, f"{head} ({'; '.join(why_not)})")


class EngineRouter:
    """The router bound to this node: it reads the probe's latest result each time it
    is asked, so an engine pulled (or removed) after start counts from the next probe.

    With `runtime="process"` it chooses among the engines installed as Python modules
    (engines/launch.py's table; `engine_images` does not apply), and the Route's
    `image` names the module that runs it with the package version as its tag."""

    def __init__(
        self,
        vendor: Callable[[], str | None] | str | None,
        probe: Callable[[], tuple[list[str], dict[str, str]]],
        *,
        priorities: Mapping[str, Iterable[str]] | None = None,
        images: Mapping[str, Mapping[str, str]] | None = None,
        runtime: str = "docker",
    ):
        self._vendor = vendor if callable(vendor) else (lambda: vendor)
        self.probe = probe
        self.priorities = {fmt: tuple(engines) for fmt, engines in (priorities or {}).items()}
        self.runtime = runtime
        if runtime == "process":
            self.images = {vendor: dict(engines) for vendor, engines in PROCESS_TABLE.items()}
            self.absent = "python module {} not installed for the engine interpreter"
        else:
            self.images = image_table(images)
            self.absent = "no local {} image"

    def choose(self, model_format: str, requested: str = AUTO) -> Route:
        engines, versions = self.probe()
        return route(
            self._vendor(),
            engines,
            model_format,
            priorities=self.priorities,
            requested=requested,
            images=self.images,
            versions=versions,
            absent=self.absent,
        )
