"""The heartbeat: everything the control plane knows about this node, sent every
interval. The first beat registers the node (implicit registration on the server). A
beat that fails is logged and dropped: the next interval sends a fresh one, so beats
never pile up behind a slow or absent server.

The agent owns the labels it sends (`owned_label_keys`): the server removes one the
agent sent before and leaves out now. Labels an operator set on the node are not the
agent's and stay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from heteroflow_agent import collect, inventory
from heteroflow_agent.client import AuthError, ServerClient, ServerError
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.engines import loaded, router
from heteroflow_agent.version import Version, current

logger = logging.getLogger("heteroflow_agent.heartbeat")

ENGINES_EVERY = 20  # beats between inference-engine probes
MODELS_EVERY = 12  # beats between model-directory scans
CACHED_MODELS_LABEL = "heteroflow.cache/models"  # the scanner's model names, comma-separated
LABEL_MAX = 4096  # a label value's limit in the heartbeat schema


@dataclass
class TaskReport:
    """What the executor knows about the tasks it runs. None: no executor is running, so
    the node says nothing about task liveness (absent is unknown, [] would mean "none")."""

    live_task_ids: list[int] | None = None
    task_health: list[dict] = field(default_factory=list)
    serving: dict[int, int] = field(default_factory=dict)  # inference task id -> its host port


class Heartbeat:
    def __init__(
        self,
        config: AgentConfig,
        client: ServerClient,
        *,
        detect_gpus: Callable[[], object],
        engine: collect.ContainerEngine | None = None,
        tasks: Callable[[], TaskReport] = TaskReport,
        version: Version | None = None,
        on_scheduled: Callable[[list[int]], None] | None = None,
        on_delivered: Callable[[], None] | None = None,
        process_engines: Callable[[], tuple[list[str], dict[str, str]]] | None = None,
        process_refusal: str = "",
    ):
        self.config, self.client = config, client
        # why the process runtime runs no tasks though allowed (it would run them as root):
        # the node says so rather than take tasks nobody starts
        self.process_refusal = process_refusal
        self.detect_gpus = detect_gpus
        self.engine = engine or collect.ContainerEngine()
        self.tasks = tasks
        self.on_scheduled = on_scheduled  # the answer lists tasks waiting for this node
        self.on_delivered = on_delivered  # any beat that got through
        # the process runtime's engine probe (engines installed as Python modules); None
        # when tasks run in containers, whose engines are the local images
        self.process_engines = process_engines
        self.version = version or current()
        self.facts = {**collect.host_facts(), **inventory.cpu_facts()}
        self.load = collect.LoadSampler()
        self.beats = 0
        self.engines: tuple[list[str], dict[str, str]] = ([], {})
        self.images = router.image_table(config.engine_images)
        self.models: list[dict] = []
        self.loaded = loaded.LoadedModels()
        self.registered = False

    def payload(self) -> dict:
        """One beat's body. Probes that are slow or rarely change run every few beats."""
        engine = self.engine.state()
        gpus = self.detect_gpus()
        if self.beats % ENGINES_EVERY == 0:
            # the router reads self.engines each time it is asked: a change counts at once
            if self.process_engines is not None:
                self.engines = self.process_engines()
            elif engine.available:
                vendor = getattr(gpus, "vendor", None)
                self.engines = inventory.engines_from_tags(self.engine.image_tags(), vendor, self.images)
        if self.beats % MODELS_EVERY == 0:
            self.models = inventory.scan_models(self.config.scanned_model_dirs)
        processes = self.config.allow_process_runtime and not self.process_refusal
        exec_mode = "docker" if engine.available else ("process" if processes else "none")
        address = collect.primary_address()
        report = self.tasks()
        labels = {**self.config.labels, **gpus.labels, CACHED_MODELS_LABEL: cached_models_label(self.models)}
        body = {
            "node_id": self.config.node_id,
            **self.facts,
            **self.load.sample(),
            "docker_available": engine.available,
            "executable": exec_mode != "none",
            "exec_mode": exec_mode,
            "error_message": "" if exec_mode != "none" else (self.process_refusal or engine.error),
            "is_container": gpus.is_container,  # detected once, with the slicing capabilities
            "agent_version": self.version.version,
            "agent_git_commit": self.version.git_commit,
            "agent_build_time": self.version.build_time,
            "heartbeat_interval": self.config.heartbeat_interval,
            "gpu_stats": gpus.gpus,
            "gpu_collect_failures": gpus.collect_failures,
            "gpu_collector_error": gpus.collector_error,
            "gpu_capabilities": gpus.capabilities,
            "labels": labels,
            # every label here is this agent's: one it stops sending (taken out of its
            # configuration, a topology no longer read) is removed from the node
            "owned_label_keys": sorted(labels),
            "inference_engines": self.engines[0],
            "inference_engine_versions": self.engines[1],
            "vllm_available": "vllm" in self.engines[0],
            "discovered_models": loaded.merge(self.models, self.loaded.latest(report.serving)),
        }
        if address.ip:
            body["internal_ip"] = address.ip
            if address.prefix is not None:
                body["internal_prefix"] = address.prefix
        if address.mac:
            body["mac"] = address.mac
        temperatures = [gpu["temperature"] for gpu in gpus.gpus if "temperature" in gpu]
        if temperatures:
            body["gpu_temperature"] = max(temperatures)
        used = [gpu["memory_used_mb"] for gpu in gpus.gpus if "memory_used_mb" in gpu]
        if used:
            body["gpu_memory_used_mb"] = sum(used)
        index_basis = getattr(gpus, "index_basis", None)
        if index_basis:  # how the server tells the cards apart (a card that drops out, renumbered)
            body["gpu_index_basis"] = index_basis
        health = getattr(gpus, "health", None)
        if health:  # read every 30 s by the detector; absent: this vendor reports none
            body["gpu_health"] = health
        if report.live_task_ids is not None:
            body["live_task_ids"] = report.live_task_ids
            body["task_health"] = report.task_health
        return body

    def beat(self, farewell: bool = False) -> dict | None:
        """Send one beat. The server's answer, or None when it did not get through. The
        farewell (the agent is stopping) marks the node offline at once; it is tried
        once, so a stop is never held up by an absent server."""
        body = self.payload()
        if farewell:
            body["shutting_down"] = True
        self.beats += 1
        try:
            response = self.client.request(
                "POST", f"/api/v1/nodes/{self.config.node_id}/heartbeat", json=body, attempts=1 if farewell else None
            )
        except AuthError:
            logger.debug("heartbeat not accepted: the key is refused")  # the client logs the error itself once
            return None
        except ServerError as exc:
            logger.warning(
                "heartbeat not delivered (%s); the next one follows in %d s", exc, self.config.heartbeat_interval
            )
            return None
        if response.status_code != 200:
            logger.error("heartbeat refused: HTTP %d %s", response.status_code, response.text[:500])
            return None
        answer = response.json()
        if answer.get("registered") or not self.registered:
            logger.info("node %s is %s on %s", self.config.node_id, answer.get("status"), self.config.server_url)
        self.registered = True
        if answer.get("scheduled_tasks") and self.on_scheduled:
            self.on_scheduled(answer["scheduled_tasks"])
        if self.on_delivered:
            self.on_delivered()
        return answer


def cached_models_label(models: list[dict]) -> str:
    """The `heteroflow.cache/models` label: the names of the models in the node's model
    cache, comma-separated, cut at a whole name to fit a label. Always sent, empty when
    the cache is: a server older than label ownership merges labels by key, so an absent
    label would keep the last list there forever."""
    names: list[str] = []
    size = 0
    for name in dict.fromkeys(model["name"].replace(",", " ").strip() for model in models):
        if not name:
            continue
        grown = size + len(name) + (2 if names else 0)
        if grown > LABEL_MAX:
            break
        names.append(name)
        size = grown
    return ", ".join(names)
