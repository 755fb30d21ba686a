"""The agent's configuration: a JSON file, then environment variables over it, checked
as a whole. Every problem is reported at once and the agent does not start with a
configuration it would only half obey.

The node id is the node's identity on the control plane: when none is configured, one
is made on first start and kept in the data directory, so a restart (or an upgrade)
comes back as the same node.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_CONFIG_FILE = Path("/etc/heteroflow-agent/agent-config.json")
DEFAULT_DATA_DIR = Path("/var/lib/heteroflow-agent")
DEFAULT_MODEL_DIRS = ("/data/heteroflow/model-cache",)
ALWAYS_SCANNED_MODEL_DIR = "/data/models"
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_LABELS = 48
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")

# environment variable -> config key (the first one set wins)
ENVIRONMENT = {
    "server_url": ("HETEROFLOW_SERVER_URL",),
    # the local agent started by `make up` gets the control plane's own secret
    "api_key": ("HETEROFLOW_AGENT_KEY", "HETEROFLOW_AGENT_SECRET"),
    # ..._SEC: the spec's name for it
    "heartbeat_interval": ("HETEROFLOW_HEARTBEAT_INTERVAL", "HETEROFLOW_HEARTBEAT_INTERVAL_SEC"),
    "node_id": ("HETEROFLOW_NODE_ID",),
    "data_dir": ("HETEROFLOW_AGENT_DATA_DIR",),
    "allow_process_runtime": ("HETEROFLOW_ALLOW_PROCESS_RUNTIME",),
    # who the process runtime's tasks run as (runtime/process.py: an agent running as root
    # refuses to run them as root unless process_run_as_root says so)
    "process_user": ("HETEROFLOW_PROCESS_USER",),
    "process_run_as_root": ("HETEROFLOW_PROCESS_RUN_AS_ROOT",),
    "model_scan_dirs": ("HETEROFLOW_MODEL_SCAN_DIRS",),  # comma-separated
    "log_level": ("HETEROFLOW_AGENT_LOG_LEVEL",),
    "reconcile_interval": ("HETEROFLOW_RECONCILE_SECONDS",),
    "health_interval": ("HETEROFLOW_HEALTH_SECONDS",),
    "report_attempts": ("HETEROFLOW_REPORT_ATTEMPTS",),
    "report_deadline_seconds": ("HETEROFLOW_REPORT_DEADLINE_SECONDS",),
    "engine_python": ("HETEROFLOW_ENGINE_PYTHON",),
    # live task logs (logs.py)
    "log_ship_seconds": ("HETEROFLOW_LOG_SHIP_SECONDS",),
    "log_rate_bytes": ("HETEROFLOW_LOG_RATE_BYTES",),
    "log_spool_bytes": ("HETEROFLOW_LOG_SPOOL_BYTES",),
    "log_keep_bytes": ("HETEROFLOW_LOG_KEEP_BYTES",),
    # the image channel (channels/images.py)
    "image_progress_seconds": ("HETEROFLOW_IMAGE_PROGRESS_SECONDS",),
    "image_legacy_latest": ("HETEROFLOW_IMAGE_LEGACY_LATEST",),
    "image_auth_file": ("HETEROFLOW_IMAGE_AUTH_FILE",),
    # the model cache (model_cache/): where ensured models live, its budget, the hub
    # mirror, how often download progress is reported
    "model_cache_dir": ("HETEROFLOW_MODEL_CACHE_DIR",),
    "model_cache_bytes": ("HETEROFLOW_MODEL_CACHE_BYTES",),
    "model_hub_url": ("HETEROFLOW_MODEL_HUB_URL",),
    "model_hub_api": ("HETEROFLOW_MODEL_HUB_API",),
    "model_progress_seconds": ("HETEROFLOW_MODEL_PROGRESS_SECONDS",),
    # the outbound tunnel to the control plane (tunnel.py, docs/tunnel.md): on by default
    "tunnel": ("HETEROFLOW_AGENT_TUNNEL",),
}
# the image channel's test hook: remove a pulled image before its check (never on a real node)
TEST_REMOVE_AFTER_PULL = "HETEROFLOW_TEST_IMAGE_REMOVE_AFTER_PULL"
# every HETEROFLOW_* variable the agent reads (a misspelt one is warned about)
ENVIRONMENT_NAMES = frozenset(
    {name for names in ENVIRONMENT.values() for name in names} | {"HETEROFLOW_AGENT_CONFIG", TEST_REMOVE_AFTER_PULL}
)
KNOWN_KEYS = set(ENVIRONMENT) | {
    "labels",
    "connect_timeout",
    "read_timeout",
    "tool_timeout",
    "engine_priorities",
    "engine_images",
}
ENGINE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$", re.IGNORECASE)
# a user name as useradd takes it (a trailing $ for machine accounts), or a numeric uid
PROCESS_USER = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]{1,10})$")


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class AgentConfig:
    server_url: str
    api_key: str
    node_id: str
    data_dir: Path
    heartbeat_interval: int = 5
    allow_process_runtime: bool = False
    # the process runtime's tasks run as this user ("": the agent's own, refused when that
    # is root unless process_run_as_root)
    process_user: str = ""
    process_run_as_root: bool = False
    model_scan_dirs: tuple[str, ...] = DEFAULT_MODEL_DIRS
    labels: dict = field(default_factory=dict)
    connect_timeout: float = 5.0
    read_timeout: float = 15.0
    tool_timeout: float = 10.0
    log_level: str = "info"
    reconcile_interval: int = 60
    health_interval: int = 30  # seconds between card health reads (ECC, Xid...), cached between beats
    report_attempts: int = 6  # a task's final report: 1 s back-off doubling to 10 s between them
    report_deadline_seconds: float = 60.0  # ...and all of its attempts and waits within this
    # model format -> engines in the order the router tries them (replaces its default)
    engine_priorities: dict = field(default_factory=dict)
    # vendor -> engine -> image repository, over the router's table ("" removes one)
    engine_images: dict = field(default_factory=dict)
    # the interpreter that runs inference engines under the process runtime ("": the agent's own)
    engine_python: str = ""
    # the image channel: progress reports at most this often; answer a bare repository as
    # ":latest" the way an old agent does (for compatibility tests); the docker config.json
    # whose auths it pulls with ("": the docker client's own)
    image_progress_seconds: float = 60.0
    image_legacy_latest: bool = False
    image_auth_file: str = ""
    # live task logs (logs.py): batches at most this far apart; each task's output past
    # this rate is dropped (with a marker); what waits for the control plane, per task;
    # the node's own copy of each task's log (two files of half this)
    log_ship_seconds: float = 0.5
    log_rate_bytes: int = 256 * 1024
    log_spool_bytes: int = 64 * 1024 * 1024
    log_keep_bytes: int = 64 * 1024 * 1024
    # the model cache (model_cache/): ensured models live here (scanned like the model
    # dirs); its budget in bytes (0: none), evicting unused models least recently used
    # first; the operator's hub mirror ("": hub models need a URL source); progress
    # reports at most this often
    model_cache_dir: str = DEFAULT_MODEL_DIRS[0]
    model_cache_bytes: int = 0
    model_hub_url: str = ""
    model_hub_api: str = "manifest"  # or "huggingface" (HF_ENDPOINT alone sets both)
    model_progress_seconds: float = 2.0
    # keep the outbound tunnel through which users reach their tasks' ports and shells
    tunnel: bool = True

    @property
    def scanned_model_dirs(self) -> tuple[str, ...]:
        """`model_scan_dirs` replaces the defaults, but /data/models and the model cache
        are always scanned (what ensure fetched is reported as cached)."""
        dirs = list(self.model_scan_dirs)
        for always in (ALWAYS_SCANNED_MODEL_DIR, self.model_cache_dir):
            if always not in dirs:
                dirs.append(always)
        return tuple(dirs)


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """The HETEROFLOW_* variables set that the agent does not read, each with the name it
    likely meant when one is close: ["HETEROFLOW_HEARTBEAT_INTERVALS (HETEROFLOW_HEARTBEAT_INTERVAL?)"]."""
    found = []
    for name in sorted(environ):
        if name.startswith("HETEROFLOW_") and name not in ENVIRONMENT_NAMES:
            close = difflib.get_close_matches(name, ENVIRONMENT_NAMES, n=1, cutoff=0.8)
            found.append(f"{name} ({close[0]}?)" if close else name)
    return found


def load(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """The configuration from `path` (or HETEROFLOW_AGENT_CONFIG, or the default file if it
    exists) with the environment over it. Raises ConfigError naming every problem."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    raw: dict = {}
    explicit = path or environ.get("HETEROFLOW_AGENT_CONFIG")
    file = Path(explicit) if explicit else DEFAULT_CONFIG_FILE
    if explicit == "-":
        pass  # no file at all: `make up`'s agent must not pick up an installed agent's config
    elif explicit or file.exists():
        try:
            raw = json.loads(file.read_text())
            if not isinstance(raw, dict):
                raise ValueError("the file must hold a JSON object")
        except (OSError, ValueError) as exc:
            raise ConfigError([f"{file}: {exc}"]) from None
        problems += [f"{file}: unknown key '{key}'" for key in sorted(set(raw) - KNOWN_KEYS)]
    for key, names in ENVIRONMENT.items():
        for name in names:
            if environ.get(name, "") != "":
                raw[key] = environ[name]
                break

    server_url = str(raw.get("server_url") or "").rstrip("/")
    parts = urlsplit(server_url)
    if not server_url:
        problems.append("server_url is required (the control plane, e.g. http://10.0.0.5:3333)")
    elif parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append(f"server_url {server_url!r} must be an http:// or https:// URL")
    api_key = str(raw.get("api_key") or "")
    if not api_key:
        problems.append("api_key is required (the control plane's agent key)")

    interval = _number(raw, "heartbeat_interval", 5, int, 5, 300, problems)
    connect_timeout = _number(raw, "connect_timeout", 5.0, float, 0.5, 60, problems)
    read_timeout = _number(raw, "read_timeout", 15.0, float, 1, 300, problems)
    tool_timeout = _number(raw, "tool_timeout", 10.0, float, 1, 120, problems)
    reconcile_interval = _number(raw, "reconcile_interval", 60, int, 5, 3600, problems)
    health_interval = _number(raw, "health_interval", 30, int, 5, 3600, problems)
    report_attempts = _number(raw, "report_attempts", 6, int, 1, 20, problems)
    report_deadline = _number(raw, "report_deadline_seconds", 60.0, float, 1, 600, problems)
    allow_process = _boolean(raw, "allow_process_runtime", False, problems)
    process_user = str(raw.get("process_user") or "").strip()
    if process_user and not PROCESS_USER.match(process_user):
        problems.append(f"process_user {process_user!r} must be a user name or a numeric uid")
    process_as_root = _boolean(raw, "process_run_as_root", False, problems)
    log_ship = _number(raw, "log_ship_seconds", 0.5, float, 0.1, 10, problems)
    log_rate = _number(raw, "log_rate_bytes", 256 * 1024, int, 1024, 1 << 30, problems)
    log_spool = _number(raw, "log_spool_bytes", 64 * 1024 * 1024, int, 64 * 1024, 1 << 40, problems)
    log_keep = _number(raw, "log_keep_bytes", 64 * 1024 * 1024, int, 0, 1 << 40, problems)
    image_progress = _number(raw, "image_progress_seconds", 60.0, float, 0, 600, problems)
    image_legacy = _boolean(raw, "image_legacy_latest", False, problems)
    image_auth_file = str(raw.get("image_auth_file") or "")
    if image_auth_file and not image_auth_file.startswith("/"):
        problems.append(f"image_auth_file {image_auth_file!r} must be an absolute path (a docker config.json)")
    model_cache_dir = str(raw.get("model_cache_dir") or DEFAULT_MODEL_DIRS[0])
    if not model_cache_dir.startswith("/"):
        problems.append(f"model_cache_dir {model_cache_dir!r} must be an absolute path")
    model_cache_bytes = _number(raw, "model_cache_bytes", 0, int, 0, 1 << 60, problems)
    model_hub_url = str(raw.get("model_hub_url") or "").rstrip("/")
    model_hub_api = str(raw.get("model_hub_api") or "").lower()
    if not model_hub_url and environ.get("HF_ENDPOINT"):
        # a Hugging Face–compatible endpoint, named the way huggingface_hub reads it
        model_hub_url, model_hub_api = environ["HF_ENDPOINT"].rstrip("/"), model_hub_api or "huggingface"
    model_hub_api = model_hub_api or "manifest"
    if model_hub_api not in ("manifest", "huggingface"):
        problems.append(f"model_hub_api {model_hub_api!r} must be manifest or huggingface")
    hub_parts = urlsplit(model_hub_url)
    if model_hub_url and (hub_parts.scheme not in ("http", "https") or not hub_parts.netloc):
        problems.append(f"model_hub_url {model_hub_url!r} must be an http:// or https:// URL")
    model_progress = _number(raw, "model_progress_seconds", 2.0, float, 0, 600, problems)
    tunnel = _boolean(raw, "tunnel", True, problems)
    log_level = str(raw.get("log_level") or "info").lower()
    if log_level not in ("debug", "info", "warning", "error"):
        problems.append(f"log_level {log_level!r} must be debug, info, warning or error")

    dirs = raw.get("model_scan_dirs", DEFAULT_MODEL_DIRS)
    if isinstance(dirs, str):
        dirs = [part.strip() for part in dirs.split(",") if part.strip()]
    if not isinstance(dirs, (list, tuple)) or not all(isinstance(d, str) and d.startswith("/") for d in dirs):
        problems.append("model_scan_dirs must be a list of absolute paths")
        dirs = DEFAULT_MODEL_DIRS

    labels = raw.get("labels", {})
    if isinstance(labels, dict) and len(labels) > MAX_LABELS:
        problems.append(f"at most {MAX_LABELS} labels (the heartbeat carries 64, some are the agent's own)")
        labels = {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and LABEL_KEY.match(k) and isinstance(v, str) and len(v) <= 4096 for k, v in labels.items()
    ):
        problems.append("labels must map names (letters, digits, . _ / -) to strings")
        labels = {}

    priorities = raw.get("engine_priorities", {})
    if not isinstance(priorities, dict) or not all(
        isinstance(fmt, str)
        and ENGINE_NAME.match(fmt)
        and isinstance(engines, list)
        and engines
        and all(isinstance(e, str) and ENGINE_NAME.match(e) for e in engines)
        for fmt, engines in priorities.items()
    ):
        problems.append('engine_priorities must map model formats to lists of engines, e.g. {"gguf": ["llama.cpp"]}')
        priorities = {}
    images = raw.get("engine_images", {})
    if not isinstance(images, dict) or not all(
        isinstance(vendor, str)
        and isinstance(engines, dict)
        and all(
            isinstance(e, str) and ENGINE_NAME.match(e) and isinstance(r, str) and ":" not in r.rsplit("/", 1)[-1]
            for e, r in engines.items()
        )
        for vendor, engines in images.items()
    ):
        problems.append(
            "engine_images must map vendors to {engine: image repository without a tag}, "
            'e.g. {"hygon": {"vllm": "registry.example/dcu/vllm"}}'
        )
        images = {}

    engine_python = str(raw.get("engine_python") or "")
    if engine_python and not (engine_python.startswith("/") and os.access(engine_python, os.X_OK)):
        problems.append(f"engine_python {engine_python!r} must be the absolute path of an executable Python")

    data_dir = Path(str(raw.get("data_dir") or DEFAULT_DATA_DIR))
    node_id = str(raw.get("node_id") or "")
    if node_id and not NODE_ID.match(node_id):
        problems.append(f"node_id {node_id!r}: 1-128 letters, digits, '.', '_', ':' or '-'")
    if problems:
        raise ConfigError(problems)
    if not node_id:
        node_id = persistent_node_id(data_dir)
    return AgentConfig(
        server_url=server_url,
        api_key=api_key,
        node_id=node_id,
        data_dir=data_dir,
        heartbeat_interval=interval,
        allow_process_runtime=allow_process,
        process_user=process_user,
        process_run_as_root=process_as_root,
        model_scan_dirs=tuple(dirs),
        labels=dict(labels),
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        tool_timeout=tool_timeout,
        log_level=log_level,
        reconcile_interval=reconcile_interval,
        health_interval=health_interval,
        report_attempts=report_attempts,
        report_deadline_seconds=report_deadline,
        engine_priorities={fmt.lower(): [e.lower() for e in engines] for fmt, engines in priorities.items()},
        engine_images={v.lower(): {e.lower(): r for e, r in engines.items()} for v, engines in images.items()},
        engine_python=engine_python,
        image_progress_seconds=image_progress,
        image_legacy_latest=image_legacy,
        image_auth_file=image_auth_file,
        log_ship_seconds=log_ship,
        log_rate_bytes=log_rate,
        log_spool_bytes=log_spool,
        log_keep_bytes=log_keep,
        model_cache_dir=model_cache_dir,
        model_cache_bytes=model_cache_bytes,
        model_hub_url=model_hub_url,
        model_hub_api=model_hub_api,
        model_progress_seconds=model_progress,
        tunnel=tunnel,
    )


def persistent_node_id(data_dir: Path) -> str:
    """The id kept in `data_dir/node-id`, made on first start: the host name (cleaned)
    and a random suffix, so two machines with the same name stay two nodes."""
    path = data_dir / "node-id"
    try:
        kept = path.read_text().strip()
        if NODE_ID.match(kept):
            return kept
    except OSError:
        pass
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._")[:100] or "node"
    node_id = f"{host}-{uuid.uuid4().hex[:8]}"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(node_id + "\n")
        temporary.replace(path)
    except OSError as exc:
        raise ConfigError([f"cannot keep the node id in {path}: {exc} (set data_dir or node_id)"]) from None
    return node_id


def _number(raw, key, default, kind, low, high, problems):
    value = raw.get(key, default)
    try:
        number = kind(value)
        if isinstance(value, bool) or (kind is int and float(value) != number):
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"{key} {value!r} is not a {'whole number' if kind is int else 'number'}")
        return default
    if not low <= number <= high:
        problems.append(f"{key} {number} is outside {low}..{high}")
        return default
    return number


def _boolean(raw, key, default, problems):
    value = raw.get(key, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    problems.append(f"{key} {value!r} is not true or false")
    return default
