"""The image channel: operators' pull and check requests for this node's container engine
(issue 19; the server side and the request's state machine are in docs/images.md).

A poller of its own asks the control plane every 5 s for this node's pending image
requests, claims one by PUT (a CAS: 409 means another claim won, or the server moved it
on) and hands it to a worker thread of its own; one request is executed at a time, and the
next one is claimed only when the worker is free. A pull goes through the Docker API with
progress events: a progress report at the start, then at most every 60 s and only when the
pull moved (a stalled pull reports nothing, so the server's janitor judges it by the time
of its last progress). The final report carries the check of what was asked:

- a tag or digest reference: exact match (the engine's image by that name, and its RepoTags
  or RepoDigests must name it: no short-name or prefix guessing);
- a bare repository: every local tag of that repository with its image id and size. An
  old agent answered a bare "repo/x" as "repo/x:latest" (exact); `legacy_latest` answers
  that way, so the server's compatibility can be tested end to end.

This path is deliberately separate from a task's own pull (runtime/docker.py): its own
engine client and connection, its own thread, no shared code, constants or locks, so a
10 GB pre-warm never holds up a task's pull. Credentials are the node's engine
configuration (a docker config.json's auths: `auth_file`, else the docker client's own),
never a task's.

The docker SDK is imported lazily (a node without it runs no channel).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from heteroflow_agent.client import ServerClient, ServerError

logger = logging.getLogger("heteroflow_agent.channels.images")

PATH = "/api/v1/agent/image-requests"
POLL_SECONDS = 5.0
PROGRESS_SECONDS = 60.0
# One engine call, and one silence of the pull's event stream: longer than the server's
# 10 minutes without progress, so the server judges a stall before the agent gives up.
ENGINE_TIMEOUT = 900.0
ERROR_MAX = 4000
MESSAGE_MAX = 500
_HUB = "docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"})
_DONE = frozenset({"download complete", "pull complete", "already exists"})
# events with an id that is no layer: Docker's "Pulling from library/busybox" (id: the tag)
_NOT_A_LAYER = ("pulling from", "digest:", "status:")


class ImageError(Exception):
    """The engine could not do what was asked; the text is the engine's own error."""


# ---- references (this channel's own reading of them) --------------------------------------


def parse(reference: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of `reference` as written: no tag and no digest is a bare
    repository. The server checked the grammar; this only splits."""
    ref = reference.strip()
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
    tag = None
    slash, colon = ref.rfind("/"), ref.rfind(":")
    if colon > slash:
        ref, tag = ref[:colon], ref[colon + 1 :]
    return ref, tag, digest


def canonical(name: str) -> str:
    """A repository the way the engine lists it: docker.io and library/ added for Docker Hub."""
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        registry, path = parts[0].lower(), "/".join(parts[1:])
    else:
        registry, path = _HUB, name
    if registry in _HUB_ALIASES:
        registry = _HUB
        if "/" not in path:
            path = "library/" + path
    return f"{registry}/{path}"


def _listed(entry: str) -> tuple[str, str | None, str | None] | None:
    if not entry or entry.startswith("<none>"):
        return None
    name, tag, digest = parse(entry)
    return canonical(name), tag, (digest or "").lower() or None


# ---- the channel -------------------------------------------------------------------------


class ImageChannel:
    def __init__(
        self,
        node_id: str,
        client: ServerClient,
        *,
        base_url: str | None = None,
        poll_seconds: float = POLL_SECONDS,
        progress_seconds: float = PROGRESS_SECONDS,
        engine_timeout: float = ENGINE_TIMEOUT,
        legacy_latest: bool = False,
        auth_file: str | None = None,
        after_pull: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """base_url: the engine (None: DOCKER_HOST and the docker environment). after_pull:
        a test hook called with the reference between the pull and its check."""
        self.node_id = node_id
        self.client = client
        self.base_url = base_url
        self.poll_seconds = poll_seconds
        self.progress_seconds = progress_seconds
        self.engine_timeout = engine_timeout
        self.legacy_latest = legacy_latest
        self.auth_file = auth_file
        self.after_pull = after_pull
        self.clock = clock
        self.wake = threading.Event()  # poll now (the worker just finished)
        self.idle = threading.Event()  # the worker holds no request
        self.idle.set()
        self._handoff: queue.Queue = queue.Queue(maxsize=1)
        self._docker = None
        self._docker_lock = threading.Lock()

    # -- the engine --

    def _engine(self):
        with self._docker_lock:
            if self._docker is None:
                import docker
                import docker.utils

                kwargs = {"base_url": self.base_url} if self.base_url else docker.utils.kwargs_from_env()
                self._docker = docker.DockerClient(timeout=self.engine_timeout, **kwargs)
            return self._docker

    def _auth(self, name: str) -> dict | None:
        """The node's credentials for the registry of `name`: from `auth_file` (a docker
        config.json) when configured, else None (the docker client then uses its own
        config.json, which is the node's too)."""
        if not self.auth_file:
            return None
        import docker.auth

        registry = canonical(name).split("/", 1)[0]
        config = docker.auth.load_config(config_path=self.auth_file)
        found = docker.auth.resolve_authconfig(config, registry if registry != _HUB else None)
        return dict(found) if found else None

    def close(self) -> None:
        with self._docker_lock:
            if self._docker is not None:
                self._docker.close()
                self._docker = None

    # -- the control plane --

    def pending(self) -> list[dict]:
        response = self.client.request("GET", PATH, params={"node_id": self.node_id, "status": "pending"})
        if response.status_code != 200:
            raise ServerError(f"GET {PATH}: HTTP {response.status_code}")
        return list(response.json().get("results") or [])

    def _put(self, request_id: int, body: dict) -> bool:
        """True when the server took the report; False on 409 (or another refusal)."""
        response = self.client.request("PUT", f"{PATH}/{request_id}", json={"node_id": self.node_id, **body})
        if response.status_code == 200:
            return True
        logger.warning(
            "image request %s: the server refused %s (HTTP %s)", request_id, body["status"], response.status_code
        )
        return False

    def claim(self, request: dict) -> bool:
        return self._put(request["id"], {"from_status": "pending", "status": "processing"})

    # -- the loop --

    def poll(self) -> int | None:
        """One round: when the worker is free, claim the oldest pending request that can be
        won and hand it over. The claimed request's id, or None."""
        if not self.idle.is_set():
            return None
        for request in self.pending():
            if self.claim(request):
                self.idle.clear()
                self._handoff.put(request)
                return request["id"]
        return None

    def run(self, stop: threading.Event) -> None:
        """The poller; starts the worker. Returns when `stop` is set (a request in hand
        goes on in the worker, a daemon thread, until the process ends)."""
        worker = threading.Thread(target=self._work, args=(stop,), name="image-worker", daemon=True)
        worker.start()
        while not stop.is_set():
            try:
                self.poll()
            except Exception:
                logger.exception("image request poll failed")
            self.wake.wait(self.poll_seconds)
            self.wake.clear()

    def _work(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                request = self._handoff.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.handle(request)
            except Exception:
                logger.exception("image request %s failed in the agent", request.get("id"))
            finally:
                self.idle.set()
                self.wake.set()

    def handle(self, request: dict) -> dict | None:
        """Execute a claimed request and send its final report; the report, or None when
        the server had moved the request on (a refused progress report)."""
        final = self.execute(request)
        if final is None:
            return None
        try:
            self._put(request["id"], final)
        except ServerError as exc:
            logger.error("image request %s: the final report was not delivered: %s", request["id"], exc)
        return final

    def execute(self, request: dict) -> dict | None:
        """The final report's body (without node_id) of a claimed request."""
        try:
            if request.get("action") == "pull":
                return self._pull(request)
            if request.get("action") != "check":
                raise ImageError(f"this agent does not know the action {request.get('action')!r}")
            return {
                "from_status": "processing",
                "status": "completed",
                "result": {"images": [self.check(ref) for ref in request["references"]]},
            }
        except _Moved:
            return None
        except ImageError as exc:
            return {"from_status": "processing", "status": "failed", "error": str(exc)[:ERROR_MAX] or "failed"}

    # -- pull --

    def _pull(self, request: dict) -> dict | None:
        reference = request["references"][0]
        name, tag, digest = parse(reference)
        target = f"{name}@{digest}" if digest else f"{name}:{tag or 'latest'}"
        tracker = _Progress()
        self._progress(request["id"], tracker.body(f"pulling {target}"))
        last = self.clock()
        logger.info("image request %s: pulling %s", request["id"], target)
        try:
            api = self._engine().api
            if digest:
                events = api.pull(f"{name}@{digest}", stream=True, decode=True, auth_config=self._auth(name))
            else:
                events = api.pull(name, tag=tag or "latest", stream=True, decode=True, auth_config=self._auth(name))
            for event in events:
                if not isinstance(event, dict):
                    continue
                if event.get("error") or event.get("errorDetail"):
                    detail = (event.get("errorDetail") or {}).get("message") or event.get("error")
                    raise ImageError(f"pull of {target} failed: {detail}")
                if tracker.add(event) and self.clock() - last >= self.progress_seconds:
                    self._progress(request["id"], tracker.body())
                    last = self.clock()
        except (ImageError, _Moved):
            raise
        except Exception as exc:  # the SDK's, the transport's: the engine's own words
            raise ImageError(f"pull of {target} failed: {_explain(exc)}") from None
        if self.after_pull is not None:
            self.after_pull(reference)
        check = self.check(reference)
        logger.info("image request %s: pulled %s (present: %s)", request["id"], target, check["present"])
        return {"from_status": "processing", "status": "completed", "result": {"images": [check]}}

    def _progress(self, request_id: int, progress: dict) -> None:
        body = {"from_status": "processing", "status": "processing", "progress": progress}
        try:
            if not self._put(request_id, body):
                raise _Moved()
        except ServerError as exc:  # the next report may get through; the pull goes on
            logger.warning("image request %s: a progress report was not delivered: %s", request_id, exc)

    # -- check --

    def check(self, reference: str) -> dict:
        """CHECK_ITEM of `reference` on this engine."""
        name, tag, digest = parse(reference)
        if tag is None and digest is None:
            if self.legacy_latest:  # what an agent from before repository matching answers
                return self._exact(f"{reference}:latest")
            return self._repository(reference, name)
        return self._exact(reference)

    def _images(self) -> list:
        try:
            return self._engine().images.list()
        except Exception as exc:
            raise ImageError(f"cannot list the engine's images: {_explain(exc)}") from None

    def _exact(self, reference: str) -> dict:
        import docker.errors

        name, tag, digest = parse(reference)
        want = (canonical(name), None if digest else tag, (digest or "").lower() or None)
        item = {"reference": reference, "present": False, "match": "exact", "image_id": None, "size_bytes": None}
        try:
            image = self._engine().images.get(reference)
        except docker.errors.ImageNotFound:
            return {**item, "tags": []}
        except Exception as exc:
            raise ImageError(f"cannot inspect {reference}: {_explain(exc)}") from None
        names = image.attrs.get("RepoDigests" if digest else "RepoTags") or []
        for entry in names:
            seen = _listed(entry)
            if seen and seen[0] == want[0] and (seen[2] == want[2] if digest else seen[1] == want[1]):
                return {**item, "present": True, "image_id": image.id, "size_bytes": _size(image), "tags": []}
        # the engine resolved the name to some other image (a short name, a search registry)
        return {**item, "tags": []}

    def _repository(self, reference: str, name: str) -> dict:
        repo = canonical(name)
        tags = []
        for image in self._images():
            for entry in image.attrs.get("RepoTags") or []:
                seen = _listed(entry)
                if seen and seen[0] == repo and seen[1]:
                    tags.append({"tag": f"{reference}:{seen[1]}", "image_id": image.id, "size_bytes": _size(image)})
        tags.sort(key=lambda t: t["tag"])
        ids = {t["image_id"] for t in tags}
        one = tags[0] if len(ids) == 1 else None
        return {
            "reference": reference,
            "present": bool(tags),
            "match": "repository",
            "image_id": one["image_id"] if one else None,
            "size_bytes": one["size_bytes"] if one else None,
            "tags": tags,
        }


class _Moved(Exception):
    """The server refused a progress report: the request is no longer this agent's."""


class _Progress:
    """A pull's progress from the engine's events: layers seen and done, bytes."""

    def __init__(self):
        self.layers: dict[str, tuple[int | None, int | None]] = {}  # id -> (current, total)
        self.done: set[str] = set()
        self.message = ""

    def add(self, event: dict) -> bool:
        """Take one event; True when it moved something. Bytes are the download's
        ("Downloading": current of total, compressed); extraction is not counted twice."""
        before = (len(self.layers), len(self.done), self._bytes(), self.message)
        status = str(event.get("status") or "")
        lowered = status.lower()
        layer = event.get("id")
        if layer and status and not lowered.startswith(_NOT_A_LAYER):
            current, total = self.layers.get(layer, (None, None))
            detail = event.get("progressDetail") or {}
            if lowered == "downloading":
                current = detail.get("current") if isinstance(detail.get("current"), int) else current
                total = detail.get("total") if isinstance(detail.get("total"), int) else total
            if lowered in _DONE:
                self.done.add(layer)
                current = total if total is not None else current
            self.layers[layer] = (current, total)
            self.message = f"{layer}: {status}"
        elif status:
            self.message = status
        return before != (len(self.layers), len(self.done), self._bytes(), self.message)

    def _bytes(self) -> tuple[int | None, int | None]:
        currents = [c for c, _ in self.layers.values() if c is not None]
        totals = [t for _, t in self.layers.values() if t is not None]
        return (sum(currents) if currents else None, sum(totals) if totals else None)

    def body(self, message: str | None = None) -> dict:
        done, total = self._bytes()
        return {
            "layers_done": len(self.done),
            "layers_total": len(self.layers),
            "bytes_done": done,
            "bytes_total": total,
            "message": (message if message is not None else self.message)[:MESSAGE_MAX],
        }


def _size(image) -> int | None:
    size = image.attrs.get("Size")
    return size if isinstance(size, int) and size >= 0 else None


def _explain(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc) or type(exc).__name__
