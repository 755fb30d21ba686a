"""Ensure: a replica's model is present on this node before its engine starts.

By the model's source kind (`serving.source_kind`, from the model registry):
- `path`: the weights are on shared (or local) storage: the path must exist, else the
  replica fails before its engine starts, saying which path is missing;
- `hub`: downloaded from the operator's mirror (fetch.py: a manifest listing, or a
  Hugging Face–compatible endpoint) into the model cache, room
  made under the budget first (store.py), progress reported while it downloads;
- `image`: the image is pulled and its model folder copied out (image.py) into the
  model cache, room made and progress reported as for a hub model; a node without a
  container engine fails it, saying so.
A serving without `source_kind` (a task made by hand, or an older server) is launched
as it is, as before.

The replica's engine is then given the local path: the entry's folder, or for a GGUF
model the entry's first .gguf file (llama.cpp takes a file; a split model's first part
names the rest).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from heteroflow_agent.client import ServerClient, ServerError
from heteroflow_agent.model_cache.fetch import MANIFEST_API, Fetcher, hub_of
from heteroflow_agent.model_cache.image import ImageExporter
from heteroflow_agent.model_cache.progress import Progress, ProgressThrottle, QueuedReports
from heteroflow_agent.model_cache.store import EnsureCancelled, EnsureError, ModelStore, entry_key, tree_size

logger = logging.getLogger("heteroflow_agent.model_cache")

PATH, HUB, IMAGE = "path", "hub", "image"

# what the control plane is told: (task id, state, the fields of that state)
Report = Callable[[int, str, dict], None]


@dataclass(frozen=True)
class Ensured:
    source: str  # what the engine loads
    key: str = ""  # the cache entry ("" for a path on shared storage)
    fetched: bool = False  # this ensure downloaded (some of) it
    fetched_bytes: int = 0
    seconds: float = 0.0


class ModelEnsurer:
    def __init__(
        self,
        store: ModelStore,
        *,
        mirror: str = "",
        hub_api: str = MANIFEST_API,
        fetcher: Fetcher | None = None,
        images: ImageExporter | None = None,
        report: Report | None = None,
        progress_interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.mirror, self.hub_api = store, mirror, hub_api
        self.fetcher = fetcher or Fetcher()
        self.images = images  # None: no container engine here, image models cannot be fetched
        self.report = report or (lambda task_id, state, fields: None)
        self.progress_interval, self.clock = progress_interval, clock

    def ensure(
        self,
        task_id: int,
        serving: Mapping,
        credentials: dict | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Ensured | None:
        """Make the serving's model present and hold it for the task. None when the
        serving names no source kind (launched as it is). Raises EnsureError, after
        telling the control plane why; a download's end is told too (its progress line
        goes, its decision is written). `credentials`: the task's registry credentials,
        for an image model. `cancelled`: asked as bytes arrive; once true, the fetch
        stops with EnsureCancelled (not reported: the agent is stopping)."""
        name = str(serving.get("model") or serving.get("source") or "")
        try:
            ensured = self._ensure(task_id, serving, credentials, cancelled)
        except EnsureCancelled:
            raise
        except EnsureError as exc:
            if not str(exc).startswith(f"model {name}"):  # every reason names the model
                exc = type(exc)(f"model {name}: {exc}")
            self.report(task_id, "failed", {"model": name, "message": str(exc)[:2000]})
            raise exc from None
        if ensured is not None and ensured.fetched:
            self.report(
                task_id,
                "ready",
                {"model": name, "bytes_done": ensured.fetched_bytes, "seconds": round(ensured.seconds, 1)},
            )
        return ensured

    def _ensure(
        self, task_id: int, serving: Mapping, credentials: dict | None, cancelled: Callable[[], bool] | None
    ) -> Ensured | None:
        kind = str(serving.get("source_kind") or "")
        source = str(serving.get("source") or "")
        name = str(serving.get("model") or source)
        if not kind:
            return None
        if not source:
            raise EnsureError(f"model {name}: its source is empty")
        if kind == PATH:
            if not os.path.exists(source):
                raise EnsureError(
                    f"model {name}: path {source} does not exist on this node (is the shared storage mounted?)"
                )
            return Ensured(source)
        if kind == HUB:
            return self._hub(task_id, name, source, str(serving.get("format") or ""), cancelled)
        if kind == IMAGE:
            return self._image(task_id, name, source, str(serving.get("format") or ""), credentials, cancelled)
        raise EnsureError(f"model {name}: unknown source kind {kind!r} (path, hub or image)")

    def hold(self, task_id: int, serving: Mapping) -> None:
        """An adopted replica (the agent restarted under it): its entry counts as in use."""
        if serving.get("source_kind") in (HUB, IMAGE) and serving.get("source"):
            key = entry_key(str(serving["source_kind"]), str(serving["source"]))
            if self.store.complete(key):
                self.store.hold(task_id, key)

    def release(self, task_id: int) -> None:
        self.store.release(task_id)

    # --- hub --------------------------------------------------------------------------

    def _hub(self, task_id: int, name: str, source: str, format: str, cancelled) -> Ensured:
        key = entry_key(HUB, source)
        folder = self.store.path_of(key)
        with self.store.key_lock(key):
            if self.store.complete(key):
                self.store.hold(task_id, key)
                return Ensured(loadable(folder, format), key)
            began = self.clock()
            hub = hub_of(self.mirror, source, self.hub_api)
            files = self.fetcher.listing(hub)
            total = sum(f.size for f in files)
            present = sum(_present(folder, f.path, f.size) for f in files)
            evicted = self.store.make_room(key, total, name)
            if evicted:
                logger.info("model %s: evicted %s to make room", name, ", ".join(evicted))
            folder.mkdir(parents=True, exist_ok=True)
            self.store.hold(task_id, key)  # while it downloads, nobody evicts it
            try:
                throttle = ProgressThrottle(
                    total,
                    lambda progress: self._progress(task_id, name, progress),
                    done=present,
                    interval=self.progress_interval,
                    clock=self.clock,
                )
                for item in files:
                    if (folder / item.path).is_file() and (folder / item.path).stat().st_size == item.size:
                        continue
                    self.fetcher.download(hub.files_url, item, folder, advancing(throttle, cancelled))
                throttle.finish()
                self.store.mark_complete(key, source_kind=HUB, source=source, size_bytes=total)
            except BaseException:
                self.store.release(task_id)
                raise
            finally:
                self.store.settle(key)
            seconds = self.clock() - began
            logger.info("model %s: %d bytes fetched from %s in %.1f s", name, total - present, hub.files_url, seconds)
            return Ensured(loadable(folder, format), key, True, total - present, seconds)

    # --- image ------------------------------------------------------------------------

    def _image(self, task_id: int, name: str, source: str, format: str, credentials: dict | None, cancelled) -> Ensured:
        if self.images is None:
            raise EnsureError(
                f"model {name} comes in an image ({source}) and this node has no container engine to pull it"
            )
        key = entry_key(IMAGE, source)
        folder = self.store.path_of(key)
        with self.store.key_lock(key):
            if self.store.complete(key):
                self.store.hold(task_id, key)
                return Ensured(loadable(folder, format), key)
            began = self.clock()
            bound = self.images.size_of(source, credentials)  # the image's size: the model's is at most that
            evicted = self.store.make_room(key, bound, name)
            if evicted:
                logger.info("model %s: evicted %s to make room", name, ", ".join(evicted))
            self.store.hold(task_id, key)
            try:
                throttle = ProgressThrottle(
                    bound,
                    lambda progress: self._progress(task_id, name, progress),
                    interval=self.progress_interval,
                    clock=self.clock,
                )
                self.images.export(source, folder, advancing(throttle, cancelled))
                throttle.total = throttle.done  # the archive's real size, for the last report
                throttle.finish()
                size = tree_size(folder)
                self.store.mark_complete(key, source_kind=IMAGE, source=source, size_bytes=size)
            except BaseException:
                self.store.release(task_id)
                raise
            finally:
                self.store.settle(key)
            seconds = self.clock() - began
            logger.info("model %s: %d bytes copied out of %s in %.1f s", name, size, source, seconds)
            return Ensured(loadable(folder, format), key, True, size, seconds)

    def _progress(self, task_id: int, name: str, progress: Progress) -> None:
        self.report(task_id, "fetching", {"model": name, **progress.as_payload()})


def advancing(throttle: ProgressThrottle, cancelled: Callable[[], bool] | None) -> Callable[[int], None]:
    """The throttle's advance, stopping the fetch once `cancelled()` says so."""

    def advance(count: int) -> None:
        if cancelled is not None and cancelled():
            raise EnsureCancelled("the agent is stopping: the fetch is left to resume")
        throttle.advance(count)

    return advance


def loadable(folder: Path, format: str) -> str:
    """What the engine loads from an entry: a GGUF model's first .gguf file, else the
    folder (a Hugging Face style checkpoint)."""
    if format == "gguf":
        ggufs = sorted(p for p in folder.rglob("*.gguf") if p.is_file())
        if ggufs:
            return str(ggufs[0])
    return str(folder)


def _present(folder: Path, path: str, size: int) -> int:
    """Bytes of a listed file already here: whole, or the part a cut download left."""
    for candidate in (folder / path, folder / (path + ".part")):
        try:
            return min(candidate.stat().st_size, size)
        except OSError:
            continue
    return 0


def server_report(client: ServerClient, node_id: str) -> QueuedReports:
    """Ensure's reports to the control plane (POST .../inference-replicas/{task}/model-ensure),
    best effort, from their own thread (progress.QueuedReports: the download never waits
    for them): one attempt each, a report that does not get through is logged and the
    download goes on (the next one carries the newer figures)."""

    def send(task_id: int, state: str, fields: dict) -> None:
        try:
            response = client.request(
                "POST",
                f"/api/v1/inference-replicas/{task_id}/model-ensure",
                json={"node_id": node_id, "state": state, **fields},
                attempts=1,
            )
        except ServerError as exc:
            logger.info("task %s: model %s report not sent (%s)", task_id, state, exc)
            return
        if response.status_code not in (200, 201, 204):
            logger.info("task %s: model %s report refused: HTTP %d", task_id, state, response.status_code)

    return QueuedReports(send)
