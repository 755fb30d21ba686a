"""The docker runtime: tasks run as containers of any Docker-compatible engine (Docker, or
Podman's Docker API service), driven through the docker SDK.

Every task is the container `task-{id}`, labelled `heteroflow.managed=true` and
`heteroflow.task-id=<id>`; the labels are how a restarted agent finds (adopts) the
containers an earlier agent process started, and nothing without them is ever touched.
Containers are deliberately not auto-removed: the executor reads the exit code and the log
tail after the task ends and removes the container once the outcome was delivered.

Containers use the host's network (a service listens on the host port the executor put in
its env) and optionally the host's IPC namespace or a larger /dev/shm.

Engine errors (unreachable, API errors) surface as RuntimeError_ from every method, also
state() and tasks(): "the engine could not say" must never read as "no such task".

The docker SDK is imported lazily, so importing this module costs nothing on a node
without it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from datetime import datetime, timedelta, timezone

from heteroflow_agent.runtime.base import (
    LOG_TAIL_LINES,
    OUTPUT_READ_BYTES,
    OutputLine,
    OutputRead,
    Runtime,
    RuntimeError_,
    TaskReach,
    TaskSpec,
    TaskState,
    split_output,
    task_name,
)

logger = logging.getLogger("heteroflow_agent.runtime.docker")

MANAGED_LABEL = "heteroflow.managed"
TASK_ID_LABEL = "heteroflow.task-id"

PULL_ATTEMPTS = 3
PULL_ATTEMPT_TIMEOUT = 300.0  # seconds, each attempt
PULL_RETRY_DELAY = 2.0  # seconds between attempts

# Statuses of a leftover container of the same task that start() may replace.
_REPLACEABLE = frozenset({"exited", "created", "dead"})

DOCKER_HUB = "docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"})
_REFERENCE_CHARS = re.compile(r"[A-Za-z0-9._:/@+-]+")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_TIME = re.compile(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?")


# ---- image references -------------------------------------------------------------------


def split_reference(reference: str) -> tuple[str, str | None, str | None]:
    """(canonical repository, tag, digest) of an image reference, normalized the way Docker
    does: no registry means docker.io, a one-part Docker Hub name means library/NAME, and
    no tag and no digest means the tag `latest`. With a digest the tag is None (the digest
    is what identifies the image). Raises RuntimeError_ for what is no image reference."""
    ref = (reference or "").strip()
    if not ref or not _REFERENCE_CHARS.fullmatch(ref) or ref.count("@") > 1:
        raise RuntimeError_(f"not an image reference: {reference!r}")
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise RuntimeError_(f"not an image digest in {reference!r}")
        digest = digest.lower()
    tag = None
    slash, colon = ref.rfind("/"), ref.rfind(":")
    if colon > slash:
        ref, tag = ref[:colon], ref[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise RuntimeError_(f"not an image tag in {reference!r}")
    parts = ref.split("/")
    if any(not part for part in parts):
        raise RuntimeError_(f"not an image reference: {reference!r}")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        registry, path = parts[0].lower(), "/".join(parts[1:])
    else:
        registry, path = DOCKER_HUB, ref
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in path:
            path = "library/" + path
    if digest:
        tag = None
    elif tag is None:
        tag = "latest"
    return f"{registry}/{path}", tag, digest


def registry_of(reference: str) -> str:
    """The registry host an image reference is pulled from (docker.io for Docker Hub)."""
    return split_reference(reference)[0].split("/", 1)[0]


def _normal_registry(registry: str) -> str:
    host = re.sub(r"^[a-z]+://", "", (registry or "").strip().lower()).split("/", 1)[0]
    return DOCKER_HUB if host in _HUB_ALIASES else host


def image_present(reference: str, images: list[dict]) -> bool:
    """Whether `reference` is exactly among `images` (the engine's image list): a tag
    reference matches a RepoTag, a digest reference a RepoDigest, both after Docker's
    normalization and nothing looser (no repository-prefix or short-name matching)."""
    repo, tag, digest = split_reference(reference)
    for image in images:
        if digest:
            candidates = image.get("RepoDigests") or ()
        else:
            candidates = image.get("RepoTags") or ()
        for candidate in candidates:
            if not candidate or candidate.startswith("<none>"):
                continue
            try:
                c_repo, c_tag, c_digest = split_reference(candidate)
            except RuntimeError_:
                continue
            if c_repo == repo and (c_digest == digest if digest else c_tag == tag):
                return True
    return False


# ---- engine timestamps ------------------------------------------------------------------


def parse_engine_time(value) -> float | None:
    """Seconds since the epoch from an engine timestamp (RFC 3339, nanoseconds allowed);
    None for the zero time ("0001-01-01...", never happened) or what cannot be read."""
    if not value or not isinstance(value, str) or value.startswith("0001-01-01"):
        return None
    match = _TIME.match(value.strip())
    if not match:
        return None
    day, clock, fraction, zone = match.groups()
    try:
        moment = datetime.strptime(f"{day}T{clock}", "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    offset = timedelta(0)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    seconds = moment.replace(tzinfo=timezone(offset)).timestamp()
    if fraction:
        seconds += int(fraction[:9].ljust(9, "0")) / 1e9
    return seconds


# ---- the runtime ------------------------------------------------------------------------


class DockerRuntime(Runtime):
    kind = "docker"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float = 60.0,
        pull_attempts: int = PULL_ATTEMPTS,
        pull_attempt_timeout: float = PULL_ATTEMPT_TIMEOUT,
        pull_retry_delay: float = PULL_RETRY_DELAY,
    ):
        """base_url: the engine (unix:///run/docker.sock, tcp://...); None reads DOCKER_HOST
        and the rest of the docker environment, as the docker CLI does. timeout: of one API
        call, in seconds (a stop waits its grace period on top)."""
        self._base_url = base_url
        self._timeout = timeout
        self._pull_attempts = max(1, int(pull_attempts))
        self._pull_attempt_timeout = float(pull_attempt_timeout)
        self._pull_retry_delay = max(0.0, float(pull_retry_delay))
        self._lock = threading.Lock()
        self._docker = None  # the SDK's client, made on first use

    # -- plumbing --

    def _client_kwargs(self) -> dict:
        import docker.utils

        if self._base_url:
            return {"base_url": self._base_url}
        return docker.utils.kwargs_from_env()

    def _engine_name(self) -> str:
        if self._base_url:
            return self._base_url
        import os

        return os.environ.get("DOCKER_HOST") or "the default Docker socket"

    def engine_client(self):
        """The docker SDK client of the container engine, made once (model_cache.image
        copies an image's model folder out with it)."""
        with self._lock:
            if self._docker is None:
                try:
                    import docker
                except ImportError as exc:  # the agent depends on it; a broken install
                    raise RuntimeError_(f"the docker SDK is not installed: {exc}") from exc
                with self._errors(f"cannot reach the container engine at {self._engine_name()}"):
                    self._docker = docker.DockerClient(timeout=self._timeout, **self._client_kwargs())
            return self._docker

    @contextlib.contextmanager
    def _errors(self, what: str, secret: str | None = None):
        """Turn the SDK's and the transport's errors into RuntimeError_ saying `what`."""
        import docker.errors
        import requests.exceptions

        try:
            yield
        except RuntimeError_:
            raise
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            raise RuntimeError_(f"{what}: {_scrub(_explain(exc), secret)}") from None

    def _container(self, task_id: int):
        """The managed container of the task, or None."""
        import docker.errors

        client = self.engine_client()
        with self._errors(f"cannot inspect {task_name(task_id)}"):
            try:
                container = client.containers.get(task_name(task_id))
            except docker.errors.NotFound:
                return None
        return container if _managed_by_us(container, task_id) else None

    # -- the interface --

    def available(self) -> tuple[bool, str]:
        try:
            client = self.engine_client()
            with self._errors(f"the container engine at {self._engine_name()} does not answer"):
                client.ping()
        except RuntimeError_ as exc:
            return False, str(exc)
        return True, ""

    def ensure_image(self, image: str, credentials: dict | None = None) -> None:
        split_reference(image)  # a malformed reference fails here, before any pull
        if self.image_present(image):
            return
        auth, secret = self._auth_for(image, credentials)
        last_error = "no attempt made"
        for attempt in range(1, self._pull_attempts + 1):
            logger.info("pulling %s (attempt %d of %d)", image, attempt, self._pull_attempts)
            started = time.monotonic()
            try:
                self._pull_once(image, auth, secret)
            except RuntimeError_ as exc:
                last_error = str(exc)
                logger.warning(
                    "pull of %s failed (attempt %d of %d, %.1f s): %s",
                    image,
                    attempt,
                    self._pull_attempts,
                    time.monotonic() - started,
                    last_error,
                )
            else:
                if self.image_present(image):
                    logger.info("pulled %s in %.1f s", image, time.monotonic() - started)
                    return
                last_error = "the engine reported the pull done but has no image under that exact reference"
                logger.warning("pull of %s: %s", image, last_error)
            if attempt < self._pull_attempts and self._pull_retry_delay:
                time.sleep(self._pull_retry_delay)
        raise RuntimeError_(f"cannot pull {image} after {self._pull_attempts} attempt(s): {last_error}")

    def image_present(self, image: str) -> bool:
        """Whether the engine holds `image` under exactly that reference."""
        client = self.engine_client()
        with self._errors("cannot list the engine's images"):
            images = client.api.images()
        return image_present(image, images)

    def start(self, spec: TaskSpec) -> None:
        import docker.errors
        import docker.types

        client = self.engine_client()
        name = spec.name
        self._clear_leftover(spec.task_id)
        labels = {str(k): str(v) for k, v in spec.labels.items()}
        labels[TASK_ID_LABEL] = str(spec.task_id)
        labels[MANAGED_LABEL] = "true"
        options = dict(
            image=spec.image,
            command=list(spec.command) or None,
            name=name,
            detach=True,
            auto_remove=False,
            labels=labels,
            environment={str(k): str(v) for k, v in spec.env.items()},
            network_mode="host",
            mounts=[
                docker.types.Mount(target=v.container, source=v.host, type="bind", read_only=v.read_only)
                for v in spec.volumes
            ],
        )
        if spec.workdir:
            options["working_dir"] = spec.workdir
        if spec.ipc_host:
            options["ipc_mode"] = "host"  # the host's /dev/shm: a size would not apply
        elif spec.shm_size_mb:
            options["shm_size"] = f"{int(spec.shm_size_mb)}m"
        with self._errors(f"cannot create {name} from {spec.image}"):
            try:
                container = client.containers.create(**options)
            except docker.errors.ImageNotFound:
                raise RuntimeError_(f"cannot create {name}: image {spec.image} is not on this node") from None
        try:
            with self._errors(f"cannot start {name}"):
                container.start()
        except RuntimeError_:
            with contextlib.suppress(Exception):
                container.remove(force=True, v=True)
            raise
        logger.info("started %s from %s", name, spec.image)

    def state(self, task_id: int) -> TaskState | None:
        container = self._container(task_id)
        return None if container is None else _state_of(task_id, container.attrs)

    def reach(self, task_id: int) -> TaskReach | None:
        """A running container. On the host's network (how this runtime starts them) it is
        reached at 127.0.0.1, and its ports are those its processes listen on; on a
        network of its own, at its IP, every port of it its own. Its environment, for an
        exec in it."""
        try:
            container = self._container(task_id)
        except RuntimeError_:
            return None
        if container is None or not _state_of(task_id, container.attrs).running:
            return None
        attrs = container.attrs
        env = dict(item.split("=", 1) for item in (attrs.get("Config") or {}).get("Env") or [] if "=" in item)
        if (attrs.get("HostConfig") or {}).get("NetworkMode") == "host":
            pids = container_pids((attrs.get("State") or {}).get("Pid"))
            if not pids:
                return None
            return TaskReach(task_id, "127.0.0.1", pids=pids, env=env, container=container.id)
        address = container_address(attrs)
        if not address:
            return None
        return TaskReach(task_id, address, env=env, container=container.id)

    def stop(self, task_id: int, grace_seconds: float = 10.0) -> None:
        import docker.errors

        container = self._container(task_id)
        if container is None:
            return
        grace = max(0, math.ceil(grace_seconds))
        try:
            with self._errors(f"cannot stop {task_name(task_id)}"):
                try:
                    container.stop(timeout=grace)
                except docker.errors.NotFound:
                    return
        except RuntimeError_:
            # Already stopped (some engines answer an error instead of 304): that is done.
            current = self._container(task_id)
            if current is None or not current.attrs.get("State", {}).get("Running"):
                return
            raise

    def logs_tail(self, task_id: int, lines: int = LOG_TAIL_LINES) -> str:
        import docker.errors

        if lines <= 0:
            return ""
        container = self._container(task_id)
        if container is None:
            return ""
        with self._errors(f"cannot read the logs of {task_name(task_id)}"):
            try:
                output = container.logs(stdout=True, stderr=True, tail=int(lines))
            except docker.errors.NotFound:
                return ""
        if isinstance(output, bytes):
            output = output.decode("utf-8", errors="replace")
        return output or ""

    def read_output(self, task_id: int, cursor: dict | None, limit: int = OUTPUT_READ_BYTES) -> OutputRead:
        """Each stream's lines logged after its mark (the engine's timestamp of the last
        line taken, and how many lines carry that very timestamp), asked with `since` at
        the mark's whole second: the engine's own timestamps, the same on every read,
        order them."""
        import docker.errors

        cursor = {stream: list(mark) for stream, mark in (cursor or {}).items()}
        container = self._container(task_id)
        if container is None:
            return OutputRead([], cursor)
        lines: list[OutputLine] = []
        budget = limit
        for stream in ("stdout", "stderr"):
            mark = cursor.get(stream)  # [the timestamp of the last line taken, lines taken at it]
            with self._errors(f"cannot read the output of {task_name(task_id)}"):
                try:
                    raw = container.logs(
                        stdout=stream == "stdout",
                        stderr=stream == "stderr",
                        timestamps=True,
                        since=int(mark[0]) if mark and mark[0] >= 1 else None,
                    )
                except docker.errors.NotFound:
                    return OutputRead([], cursor)
            pieces, _ = split_output(raw if isinstance(raw, bytes) else raw.encode(), final=True)
            last = mark[0] if mark else None
            count = skip = mark[1] if mark else 0
            for piece in pieces:
                stamp, _, text = piece.partition(b" ")
                instant = parse_engine_time(stamp.decode("ascii", "replace"))
                if instant is None or (last is not None and instant < last):
                    continue
                if instant == last:
                    if skip > 0:  # taken by an earlier read
                        skip -= 1
                        continue
                    count += 1
                else:
                    last, count, skip = instant, 1, 0
                if budget <= 0:
                    break
                budget -= len(text) + 1
                lines.append(OutputLine(instant, stream, text.decode("utf-8", "replace")))
                cursor[stream] = [last, count]
        return OutputRead(lines, cursor)

    def remove(self, task_id: int) -> None:
        import docker.errors

        container = self._container(task_id)
        if container is None:
            return
        with self._errors(f"cannot remove {task_name(task_id)}"):
            try:
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                return
        logger.info("removed %s", task_name(task_id))

    def tasks(self) -> dict[int, TaskState]:
        client = self.engine_client()
        with self._errors("cannot list the task containers"):
            containers = client.containers.list(
                all=True, filters={"label": f"{MANAGED_LABEL}=true"}, ignore_removed=True
            )
        held: dict[int, TaskState] = {}
        for container in containers:
            task_id = _task_id_of(container)
            if task_id is not None:
                held[task_id] = _state_of(task_id, container.attrs)
        return held

    # -- helpers --

    def _clear_leftover(self, task_id: int) -> None:
        """A container of the same name left by an earlier run of the task: replace it when
        it has ended, refuse while it runs, never touch one that is not ours."""
        import docker.errors

        client = self.engine_client()
        name = task_name(task_id)
        with self._errors(f"cannot inspect {name}"):
            try:
                leftover = client.containers.get(name)
            except docker.errors.NotFound:
                return
        if not _managed_by_us(leftover, task_id):
            raise RuntimeError_(f"a container named {name} exists that HeteroFlow did not start; not touching it")
        status = leftover.attrs.get("State", {}).get("Status") or leftover.status
        if status not in _REPLACEABLE or leftover.attrs.get("State", {}).get("Running"):
            raise RuntimeError_(f"{name} already exists and is {status}; not starting it twice")
        with self._errors(f"cannot remove the leftover {name}"):
            try:
                leftover.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass
        logger.info("removed the leftover %s (%s) before starting the task again", name, status)

    def _auth_for(self, image: str, credentials: dict | None) -> tuple[dict | None, str | None]:
        """The SDK's auth_config for pulling `image` with the task's registry credentials,
        only when they are for the registry the image comes from (a private registry's
        password is never sent to another registry)."""
        if not credentials:
            return None, None
        username = str(credentials.get("username") or "")
        password = str(credentials.get("password") or "")
        registry = _normal_registry(str(credentials.get("registry") or DOCKER_HUB))
        if not username or not password:
            logger.warning(
                "pull credentials for %s lack a username or password; pulling %s without them", registry, image
            )
            return None, None
        if registry != registry_of(image):
            logger.warning(
                "pull credentials are for %s, %s comes from %s; pulling without them",
                registry,
                image,
                registry_of(image),
            )
            return None, None
        address = "https://index.docker.io/v1/" if registry == DOCKER_HUB else registry
        return {"username": username, "password": password, "serveraddress": address}, password

    def _pull_once(self, image: str, auth: dict | None, secret: str | None) -> None:
        """One pull, bounded by the attempt timeout. The pull runs on its own client in a
        thread; past the deadline the client is closed and the attempt fails."""
        import docker

        repo, tag, digest = split_reference(image)
        source = image.strip().split("@", 1)[0]
        slash, colon = source.rfind("/"), source.rfind(":")
        if colon > slash:
            source = source[:colon]  # the repository as the user wrote it
        client = self.engine_client()
        api = docker.APIClient(
            timeout=max(1.0, self._pull_attempt_timeout), version=client.api.api_version, **self._client_kwargs()
        )
        outcome: dict = {}

        def pull() -> None:
            try:
                kwargs = {"tag": digest or tag, "stream": True, "decode": True}
                if auth:
                    kwargs["auth_config"] = auth
                for message in api.pull(source, **kwargs):
                    if isinstance(message, dict) and (message.get("error") or message.get("errorDetail")):
                        outcome["error"] = (
                            message.get("error") or (message.get("errorDetail") or {}).get("message") or str(message)
                        )
            except Exception as exc:  # reported by the caller
                outcome["error"] = _explain(exc)
            finally:
                outcome["done"] = True

        worker = threading.Thread(target=pull, name=f"pull {repo}", daemon=True)
        worker.start()
        worker.join(self._pull_attempt_timeout)
        if not outcome.get("done"):
            with contextlib.suppress(Exception):
                api.close()
            raise RuntimeError_(f"timed out after {self._pull_attempt_timeout:g} s")
        with contextlib.suppress(Exception):
            api.close()
        if outcome.get("error"):
            raise RuntimeError_(_scrub(str(outcome["error"]), secret))


def _managed_by_us(container, task_id: int) -> bool:
    labels = container.labels or {}
    return labels.get(MANAGED_LABEL) == "true" and labels.get(TASK_ID_LABEL) == str(task_id)


def _task_id_of(container) -> int | None:
    labels = container.labels or {}
    if labels.get(MANAGED_LABEL) != "true":
        return None
    try:
        task_id = int(labels.get(TASK_ID_LABEL, ""))
    except ValueError:
        return None
    # the name is the other half of the identity: a label copied onto another container is not a task
    return task_id if task_id > 0 and container.name == task_name(task_id) else None


def _state_of(task_id: int, attrs: dict) -> TaskState:
    state = attrs.get("State") or {}
    running = bool(state.get("Running"))
    exit_code = None
    if not running and state.get("Status") in ("exited", "dead"):
        with contextlib.suppress(TypeError, ValueError):
            exit_code = int(state.get("ExitCode"))
    finished_at = None if running else parse_engine_time(state.get("FinishedAt"))
    return TaskState(
        task_id=task_id,
        running=running,
        exit_code=exit_code,
        started_at=parse_engine_time(state.get("StartedAt")),
        finished_at=finished_at,
    )


def container_pids(pid) -> frozenset[int]:
    """The container's main process (as the host numbers it) and everything under it."""
    import psutil

    if not isinstance(pid, int) or pid <= 0:
        return frozenset()
    try:
        main = psutil.Process(pid)
        return frozenset({pid, *(child.pid for child in main.children(recursive=True))})
    except psutil.Error:
        return frozenset()


def container_address(attrs: dict) -> str:
    """The container's IP address (its first network's), "" when it has none."""
    settings = attrs.get("NetworkSettings") or {}
    if settings.get("IPAddress"):
        return settings["IPAddress"]
    for network in (settings.get("Networks") or {}).values():
        if (network or {}).get("IPAddress"):
            return network["IPAddress"]
    return ""


def _explain(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation) if explanation else str(exc)
    return text.strip() or type(exc).__name__


def _scrub(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text
