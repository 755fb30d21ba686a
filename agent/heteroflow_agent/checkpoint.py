"""Checkpoint resume for training tasks: when a task names a checkpoint path but no
resume point, find the newest COMPLETE checkpoint in the host directory behind that
path, so a task requeued after a lost node, an agent upgrade or a preemption carries on
instead of starting over.

Only evidence of completion counts (a half-written checkpoint is worse than none), per
framework:

- Megatron: `latest_checkpointed_iteration.txt` names N and `iter_{N:07d}/` exists;
- DeepSpeed: `latest` names a tag and `<tag>/` holds at least one `*model_states.pt`;
- TensorFlow: the `checkpoint` state file names `model_checkpoint_path` and its
  `.index` file exists;
- torch.distributed.checkpoint (DCP): a folder with a `.metadata` file;
- the platform's own marker: a folder holding `.heteroflow_complete`.

Symbolic links are never followed inside the directory; the directory itself must be
one of the task's volumes, which the executor already checked against the allow-list.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MARKER = ".heteroflow_complete"
RESUME_VARIABLE = "HETEROFLOW_RESUME_FROM_CHECKPOINT"


@dataclass(frozen=True)
class Found:
    host_path: str
    framework: str
    mtime: float


def _read(path: Path) -> str:
    if path.is_symlink() or not path.is_file():
        return ""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def complete_checkpoints(root: Path) -> list[Found]:
    """Every complete checkpoint directly in `root` (and one level of run folders)."""
    found: list[Found] = []
    for base in [root] + [entry for entry in _children(root) if _real_dir(entry)]:
        text = _read(base / "latest_checkpointed_iteration.txt")
        if text.isdigit():
            folder = base / f"iter_{int(text):07d}"
            if _real_dir(folder):
                found.append(Found(str(folder), "megatron", _mtime(folder)))
        tag = _read(base / "latest")
        if tag and "/" not in tag and _real_dir(base / tag):
            shards = [p for p in _children(base / tag) if p.name.endswith("model_states.pt") and not p.is_symlink()]
            if shards:
                found.append(Found(str(base / tag), "deepspeed", _mtime(base / tag)))
        match = re.search(r'^model_checkpoint_path:\s*"([^"/]+)"', _read(base / "checkpoint"), re.MULTILINE)
        if (
            match
            and (base / f"{match.group(1)}.index").is_file()
            and not (base / f"{match.group(1)}.index").is_symlink()
        ):
            found.append(Found(str(base / match.group(1)), "tensorflow", _mtime(base / f"{match.group(1)}.index")))
        for folder in [base] + [entry for entry in _children(base) if _real_dir(entry)]:
            if (folder / ".metadata").is_file() and not (folder / ".metadata").is_symlink():
                found.append(Found(str(folder), "dcp", _mtime(folder / ".metadata")))
            if (folder / MARKER).is_file() and not (folder / MARKER).is_symlink():
                found.append(Found(str(folder), "marker", _mtime(folder / MARKER)))
    unique = {f.host_path: f for f in found}
    return sorted(unique.values(), key=lambda f: (f.mtime, f.host_path))


def _children(folder: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(folder)]
    except OSError:
        return []


def resume_point(task: dict, volumes) -> tuple[str | None, str]:
    """(the container path to resume from, or None; what was decided, for the log and the
    task's report). `volumes`: the task's checked volumes (host, container)."""
    wanted = (task.get("checkpoint_path") or "").rstrip("/")
    if task.get("kind") != "training" or not wanted:
        return None, ""
    if task.get("resume_from_checkpoint"):
        return task["resume_from_checkpoint"], "resume point given by the task: not probed"
    volume = next(
        (v for v in volumes if wanted == v.container.rstrip("/") or wanted.startswith(v.container.rstrip("/") + "/")),
        None,
    )
    if volume is None:
        return None, f"checkpoint path {wanted} is not on a volume of the task: starting from scratch"
    host_root = Path(volume.host) / os.path.relpath(wanted, volume.container.rstrip("/") or "/")
    if host_root.is_symlink() or not host_root.is_dir():
        return None, f"no checkpoint directory at {wanted}: starting from scratch"
    candidates = complete_checkpoints(host_root)
    if not candidates:
        return None, f"no complete checkpoint under {wanted}: starting from scratch"
    newest = candidates[-1]
    inside = (
        os.path.join(wanted, os.path.relpath(newest.host_path, host_root))
        if newest.host_path != str(host_root)
        else wanted
    )
    return os.path.normpath(inside), f"resuming from {os.path.normpath(inside)} ({newest.framework})"
