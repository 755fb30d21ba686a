"""What the running inference engines have loaded: the agent reads `/v1/models` of each
inference task that has a host port (the spec, 001: "agent 还会读运行中推理容器的
/v1/models API，把已加载模型并入 discovered_models 上报").

Reading never holds up a beat: `LoadedModels.latest(ports)` answers at once with what
the last read found and starts the next read in the background (one at a time), each
request bounded by a short timeout. A task that stopped serving drops out at once.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("heteroflow_agent.engines")

READ_TIMEOUT = 1.0  # seconds per engine: a loaded engine answers /v1/models at once
MAX_MODELS_PER_ENGINE = 16


def read_models(port: int, host: str = "127.0.0.1", timeout: float = READ_TIMEOUT) -> list[dict] | None:
    """The models an OpenAI-compatible server on `port` has loaded (the `data` of its
    /v1/models), or None when it does not answer one (not up yet, not such a server)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v1/models", timeout=timeout) as answer:
            if answer.status != 200:
                return None
            body = json.loads(answer.read(1 << 20))
    except (OSError, ValueError) as exc:  # refused, timed out, not JSON
        logger.debug("port %s: no /v1/models (%s)", port, exc)
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [entry for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)][
        :MAX_MODELS_PER_ENGINE
    ]


def served_entries(task_id: int, port: int, models: list[dict]) -> list[dict]:
    """discovered_models entries for what one task serves. `path` is the engine's own
    `root` (vLLM reports the weights' path there) or the model id."""
    entries = []
    for model in models:
        root = model.get("root") if isinstance(model.get("root"), str) and model.get("root") else model["id"]
        entries.append(
            {
                "name": model["id"][:200],
                "path": root[:1024],
                "served": True,
                "task_id": task_id,
                "port": port,
            }
        )
    return entries


def merge(scanned: list[dict], served: list[dict], limit: int = 512) -> list[dict]:
    """The scanner's models with what is loaded merged in: a scanned model that an
    engine serves (same path) is marked served with its task and port; a loaded model
    not on disk here (a hub id, a path inside the image) is added. Served ones first
    when the list is cut to `limit`."""
    by_path = {entry["path"]: entry for entry in served}
    merged, used = [], set()
    for model in scanned:
        loaded = by_path.get(model["path"])
        if loaded:
            used.add(model["path"])
            merged.append({**model, "served": True, "task_id": loaded["task_id"], "port": loaded["port"]})
        else:
            merged.append(model)
    extra = [entry for entry in served if entry["path"] not in used]
    if len(merged) + len(extra) > limit:
        keep = [m for m in merged if m.get("served")] + extra
        rest = [m for m in merged if not m.get("served")]
        return (keep + rest)[:limit]
    return merged + extra


class LoadedModels:
    """The last /v1/models read of each serving task, refreshed off the beat's path."""

    def __init__(self, timeout: float = READ_TIMEOUT, host: str = "127.0.0.1"):
        self.timeout, self.host = timeout, host
        self._found: dict[int, list[dict]] = {}  # task id -> its served entries
        self._lock = threading.Lock()
        self._reading: threading.Thread | None = None

    def read_now(self, ports: Mapping[int, int]) -> list[dict]:
        """Read every serving task's /v1/models now (in parallel), keep and return them."""
        ports = dict(ports)
        found: dict[int, list[dict]] = {}
        if ports:
            with ThreadPoolExecutor(max_workers=min(8, len(ports)), thread_name_prefix="v1models") as pool:
                answers = pool.map(lambda item: (item, read_models(item[1], self.host, self.timeout)), ports.items())
                for (task_id, port), models in answers:
                    if models is not None:
                        found[task_id] = served_entries(task_id, port, models)
        with self._lock:
            self._found = found
        return self._entries(ports)

    def latest(self, ports: Mapping[int, int]) -> list[dict]:
        """What the last read found for the tasks serving now, at once; a new read
        starts in the background unless one is still running."""
        ports = dict(ports)
        with self._lock:
            if ports and (self._reading is None or not self._reading.is_alive()):
                self._reading = threading.Thread(target=self.read_now, args=(ports,), daemon=True, name="v1models")
                self._reading.start()
        return self._entries(ports)

    def wait(self, timeout: float | None = None) -> None:
        """Until the background read ends (tests, shutdown)."""
        reading = self._reading
        if reading is not None:
            reading.join(timeout)

    def _entries(self, ports: Iterable[int] | Mapping[int, int]) -> list[dict]:
        live = dict(ports) if isinstance(ports, Mapping) else {task_id: None for task_id in ports}
        with self._lock:
            return [
                entry
                for task_id, entries in sorted(self._found.items())
                if task_id in live
                for entry in entries
                if live[task_id] in (None, entry["port"])
            ]
