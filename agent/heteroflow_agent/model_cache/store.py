"""The node's model cache directory: one folder per model (its entry), named after the
model's source, with a marker file written once the model is complete. A folder
without a marker is a download in progress (or one a crash left behind: resumed by the
next ensure of the same model, evicted like any other entry otherwise).

The cache has a budget (bytes; 0: none). Making room for a model evicts the entries no
running replica uses, least recently used first (an entry's `last_used` is written
when a replica starts and when it ends using it); an entry in use is never evicted,
nor the one being made room for. When even that is not enough, NoRoom says how much is
held by what. A download in progress counts at its full size from the moment room is
made for it (its reservation, until it is complete or fails), so two models fetched at
once cannot both fit only on paper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("heteroflow_agent.model_cache")

MARKER = ".heteroflow-model.json"
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class EnsureError(RuntimeError):
    """The model cannot be made present; the message says why (it becomes the task's
    failure and the service's decision)."""


class NoRoom(EnsureError):
    pass


class EnsureCancelled(EnsureError):
    """The agent is stopping: the fetch was left where it was (a download's .part stays,
    resumed by the next ensure). Not a failure of the model: nothing is reported."""


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    size_bytes: int
    last_used: float
    complete: bool
    source: str


def entry_key(source_kind: str, source: str) -> str:
    """The folder of a model's entry: its source's last part, readable, and a digest of
    kind and source, so two sources with one last part stay two entries."""
    tail = UNSAFE.sub("-", source.rstrip("/").rsplit("/", 1)[-1]).strip("-.")[:60] or "model"
    digest = hashlib.sha256(f"{source_kind}:{source}".encode()).hexdigest()[:12]
    return f"{tail}-{digest}"


def tree_size(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


class ModelStore:
    def __init__(self, root: Path, budget_bytes: int = 0, clock=time.time):
        self.root, self.budget, self.clock = Path(root), budget_bytes, clock
        self.lock = threading.Lock()  # room is made, and uses counted, one at a time
        self.key_locks: dict[str, threading.Lock] = {}
        self.uses: dict[int, str] = {}  # task id -> the entry its replica uses
        self.reserved: dict[str, int] = {}  # entry -> its full size, while it is being fetched

    def path_of(self, key: str) -> Path:
        return self.root / key

    def key_lock(self, key: str) -> threading.Lock:
        """One ensure of an entry at a time: two replicas of one model on this node
        download it once."""
        with self.lock:
            return self.key_locks.setdefault(key, threading.Lock())

    # --- entries ----------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        found = []
        try:
            folders = [p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []
        for folder in folders:
            marker = self._marker(folder)
            if marker is not None:
                found.append(
                    Entry(
                        folder.name,
                        folder,
                        int(marker.get("size_bytes") or 0),
                        float(marker.get("last_used") or 0),
                        True,
                        str(marker.get("source") or ""),
                    )
                )
            else:
                try:
                    used = folder.stat().st_mtime
                except OSError:
                    continue
                found.append(Entry(folder.name, folder, tree_size(folder), used, False, ""))
        return found

    def complete(self, key: str) -> bool:
        return self._marker(self.path_of(key)) is not None

    def mark_complete(self, key: str, *, source_kind: str, source: str, size_bytes: int) -> None:
        now = self.clock()
        marker = {"source_kind": source_kind, "source": source, "size_bytes": size_bytes}
        self._write_marker(self.path_of(key), {**marker, "fetched_at": now, "last_used": now})

    def touch(self, key: str) -> None:
        folder = self.path_of(key)
        marker = self._marker(folder)
        if marker is not None:
            marker["last_used"] = self.clock()
            self._write_marker(folder, marker)

    # --- uses -------------------------------------------------------------------------

    def hold(self, task_id: int, key: str) -> None:
        with self.lock:
            self.uses[task_id] = key
        self.touch(key)

    def release(self, task_id: int) -> None:
        with self.lock:
            key = self.uses.pop(task_id, None)
        if key is not None:
            self.touch(key)  # its last use ended now: the LRU order counts from here

    def in_use(self) -> set[str]:
        with self.lock:
            return set(self.uses.values())

    # --- the budget -------------------------------------------------------------------

    def make_room(self, key: str, total: int, name: str) -> list[str]:
        """Evict what must go for entry `key`, `total` bytes when complete, to fit the
        budget, and reserve those bytes for it until `settle(key)`. Returns the evicted
        entries' keys. Raises NoRoom (nothing evicted, nothing reserved) when even
        evicting every entry not in use would not be enough."""
        with self.lock:
            entries = [e for e in self.entries() if e.key != key]
            here = {e.key for e in entries}
            sizes = {e.key: max(e.size_bytes, self.reserved.get(e.key, 0)) for e in entries}
            sizes |= {k: size for k, size in self.reserved.items() if k not in here and k != key}
            if self.budget <= 0 or sum(sizes.values()) + total <= self.budget:
                self.reserved[key] = total
                return []
            busy = set(self.uses.values()) | set(self.reserved)
            evictable = sorted((e for e in entries if e.key not in busy), key=lambda e: (e.last_used, e.key))
            held = sum(sizes.values()) - sum(sizes[e.key] for e in evictable)
            if held + total > self.budget:
                holders = sorted(k for k in sizes if k in busy)
                raise NoRoom(
                    f"model {name} needs {total} bytes, the model cache budget is {self.budget} bytes "
                    f"and {held} are held by models in use or being fetched"
                    + (f" ({', '.join(holders)})" if holders else "")
                    + ": raise model_cache_bytes or free the node"
                )
            used = sum(sizes.values())
            evicted = []
            for entry in evictable:
                if used + total <= self.budget:
                    break
                logger.info("model cache: evicting %s (%d bytes, least recently used)", entry.key, entry.size_bytes)
                shutil.rmtree(entry.path, ignore_errors=True)
                used -= sizes[entry.key]
                evicted.append(entry.key)
            self.reserved[key] = total
            return evicted

    def settle(self, key: str) -> None:
        """The fetch of `key` ended (complete or failed): its reservation goes; a complete
        entry counts by its marker from now on."""
        with self.lock:
            self.reserved.pop(key, None)

    # --- the marker -------------------------------------------------------------------

    @staticmethod
    def _marker(folder: Path) -> dict | None:
        try:
            data = json.loads((folder / MARKER).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def _write_marker(folder: Path, data: dict) -> None:
        temporary = folder / (MARKER + ".tmp")
        temporary.write_text(json.dumps(data, sort_keys=True))
        temporary.replace(folder / MARKER)
