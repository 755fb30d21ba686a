"""What the node offers for inference: engine images present locally, and model files
on disk. Both are probed at start and then every few beats (engines every 20, models
every 12), since operators usually install the agent first and pull images later.
Also the node's CPU facts (model and sockets, for the server's CPU power estimate),
read once at start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from heteroflow_agent.engines import router

# engine name -> the image repositories that provide it. Matched exactly, so a copy in
# a private registry (172.29.0.1:5000/lmsysorg/sglang) does not count: the control plane
# would send a task whose image the node would then try to pull from the internet. The
# engines the router chooses from take their repositories from its image table (one
# place); these others are only reported.
REPORTED_ONLY_IMAGES: dict[str, tuple[str, ...]] = {
    "tgi": ("ghcr.io/huggingface/text-generation-inference",),
    "lmdeploy": ("openmmlab/lmdeploy",),
    "ollama": ("ollama/ollama",),
    "triton": ("nvcr.io/nvidia/tritonserver",),
}


def engine_images(vendor: str | None = None, table: dict | None = None) -> dict[str, tuple[str, ...]]:
    """engine -> repositories that make it available on `vendor` (None: any vendor)."""
    routed = router.repositories_for(vendor, table if table is not None else router.image_table())
    return {**REPORTED_ONLY_IMAGES, **routed}


ENGINE_IMAGES: dict[str, tuple[str, ...]] = engine_images()
CPUINFO = "/proc/cpuinfo"
CPU_MODEL_MAX = 200  # the heartbeat schema's and nodes.cpu_model's bound


def cpu_facts(path: str | None = None) -> dict:
    """{"cpu_model": /proc/cpuinfo's "model name", "cpu_sockets": how many distinct
    "physical id"s}; a fact the file does not give is absent (ARM's cpuinfo has no model
    name; a VM's often no physical id), never guessed."""
    try:
        text = Path(path or CPUINFO).read_text(errors="replace")
    except OSError:
        return {}
    model = ""
    sockets = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), " ".join(value.split())
        if key == "model name" and value and not model:
            model = value
        elif key == "physical id" and value.isdigit():
            sockets.add(int(value))
    facts: dict = {}
    if model:
        facts["cpu_model"] = model[:CPU_MODEL_MAX]
    if sockets:
        facts["cpu_sockets"] = min(len(sockets), 1024)
    return facts


MAX_MODELS = 512
MODEL_SUFFIXES = {".safetensors": "safetensors", ".gguf": "gguf", ".bin": "pytorch", ".pt": "pytorch", ".onnx": "onnx"}


def engines_from_tags(
    tags: Iterable[str], vendor: str | None = None, table: dict | None = None
) -> tuple[list[str], dict[str, str]]:
    """(engines available, engine -> the tag found) from local `repo:tag` names. With a
    vendor, a routed engine counts only through that vendor's image (a CUDA vLLM image
    on an AMD node is not "vllm available")."""
    images = ENGINE_IMAGES if vendor is None and table is None else engine_images(vendor, table)
    versions: dict[str, str] = {}
    for tag in tags:
        repository, _, version = tag.rpartition(":")
        if not repository or "/" in version:  # "host:5000/name" without a tag
            repository, version = tag, "latest"
        for engine, repositories in images.items():
            if repository in repositories and engine not in versions:
                versions[engine] = version[:64]
    return sorted(versions), versions


def scan_models(directories: Iterable[str], limit: int = MAX_MODELS, max_depth: int = 3) -> list[dict]:
    """Models under the directories: a folder with a config.json (a Hugging Face style
    checkpoint), or a single .gguf file. Symbolic links are not followed; unreadable
    folders are skipped."""
    found: list[dict] = []
    for top in directories:
        root = Path(top)
        if not root.is_dir():
            continue
        _walk(root, 0, max_depth, found, limit)
        if len(found) >= limit:
            break
    return found[:limit]


def _walk(folder: Path, depth: int, max_depth: int, found: list[dict], limit: int) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    names = {entry.name for entry in entries}
    if "config.json" in names:
        files = [entry for entry in entries if entry.is_file(follow_symlinks=False)]
        formats = [
            MODEL_SUFFIXES[Path(entry.name).suffix] for entry in files if Path(entry.name).suffix in MODEL_SUFFIXES
        ]
        found.append(_model(folder.name, folder, sum(_size(entry) for entry in files), formats[0] if formats else "hf"))
        return
    for entry in sorted(entries, key=lambda e: e.name):
        if len(found) >= limit:
            return
        if entry.is_file(follow_symlinks=False) and entry.name.endswith(".gguf"):
            found.append(_model(Path(entry.name).stem, Path(entry.path), _size(entry), "gguf"))
        elif entry.is_dir(follow_symlinks=False) and depth < max_depth and not entry.name.startswith("."):
            _walk(Path(entry.path), depth + 1, max_depth, found, limit)


def _model(name: str, path: Path, size: int, format: str) -> dict:
    return {"name": name[:200], "path": str(path)[:1024], "size_bytes": size, "format": format}


def _size(entry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
