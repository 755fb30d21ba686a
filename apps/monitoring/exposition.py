"""What a scrape answers.

- This process group's counters and histograms: prometheus_client's default registry,
  or, with PROMETHEUS_MULTIPROC_DIR set, the sum of the files every process of the
  group (uvicorn workers, Celery pool processes) writes there.
- The standard process and Python collectors of the process that answers.
- For the web process only, the cluster snapshot: gauges computed from the database at
  scrape time. A part that fails is left out (and heteroflow_metrics_snapshot_up says
  which); a scrape never fails because of it.
"""

from __future__ import annotations

import glob
import logging
import os

from django.db import connection, transaction
from prometheus_client import REGISTRY, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from apps.alerts.choices import AlertType, Severity
from apps.core.clock import utcnow
from apps.core.redis import client as redis_client
from apps.gateway.limits import backend_in_flight
from apps.monitoring import probes, selectors
from apps.monitoring.metrics import job_label
from apps.nodes.choices import GpuState, GpuVendor, NodeStatus
from apps.scheduler import quotas

logger = logging.getLogger(__name__)

SNAPSHOT_STATEMENT_TIMEOUT_MS = 2000


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ThisProcess:
    """The standard collectors, for the process that answers the scrape (in multiprocess
    mode the default registry's copies are not used)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def collect(self):
        return self.registry.collect()


_THIS_PROCESS = ThisProcess()


def process_group_metrics():
    """The counters and histograms of this process group, plus this process's standard ones."""
    path = multiprocess_dir()
    if path is None:
        yield from REGISTRY.collect()
        return
    yield from MultiProcessCollector.merge(glob.glob(os.path.join(path, "*.db")), accumulate=True)
    yield from _THIS_PROCESS.collect()


# --- the cluster snapshot --------------------------------------------------------------------


def gpu_type_label(value: str) -> str:
    """Label values from a fixed set: a vendor we know, "none", or "other"."""
    if not value:
        return "none"
    return value if value in GpuVendor.values else "other"


def nodes_part(now):
    family = GaugeMetricFamily("heteroflow_nodes", "Nodes by status and GPU type.", labels=["status", "gpu_type"])
    counts = {}
    for status, gpu_type, n in selectors.nodes_by_status_and_gpu_type():
        key = (status, gpu_type_label(gpu_type))
        counts[key] = counts.get(key, 0) + n
    types = {gpu_type for _, gpu_type in counts} or {"none"}
    for gpu_type in sorted(types):
        for status in NodeStatus.values:
            family.add_metric([status, gpu_type], counts.get((status, gpu_type), 0))
    yield family


def gpus_part(now):
    family = GaugeMetricFamily(
        "heteroflow_gpus",
        "GPUs by type and state (busy: held in the scheduler's ledger; lost: gone from its node).",
        labels=["gpu_type", "state"],
    )
    counts = {}
    for vendor, state, n in selectors.gpus_by_type_and_state():
        key = (gpu_type_label(vendor), state)
        counts[key] = counts.get(key, 0) + n
    types = {gpu_type for gpu_type, _ in counts} or {"none"}
    for gpu_type in sorted(types):
        for state in GpuState.values:
            family.add_metric([gpu_type, state], counts.get((gpu_type, state), 0))
    yield family


def alerts_part(now):
    family = GaugeMetricFamily(
        "heteroflow_alerts_active", "Active alerts by type and severity.", labels=["type", "severity"]
    )
    counts = {(kind, severity): n for kind, severity, n in selectors.active_alerts_by_type_and_severity()}
    for kind in AlertType.values:
        for severity in Severity.values:
            family.add_metric([kind, severity], counts.get((kind, severity), 0))
    yield family


def queue_part(now):
    queue = selectors.task_queue(now)
    tasks = GaugeMetricFamily("heteroflow_tasks", "Tasks in an active (not finished) status.", labels=["status"])
    for status, n in queue["by_status"].items():
        tasks.add_metric([status], n)
    yield tasks
    yield GaugeMetricFamily(
        "heteroflow_scheduler_pending_tasks", "Tasks waiting to be scheduled.", value=queue["pending"]
    )
    yield GaugeMetricFamily(
        "heteroflow_scheduler_oldest_pending_task_age_seconds",
        "How long the oldest pending task has waited (0 when none waits).",
        value=queue["oldest_pending_age_seconds"] or 0.0,
    )


def scheduler_part(now):
    running = probes.scheduler_state(now) == "running"
    yield GaugeMetricFamily(
        "heteroflow_scheduler_running",
        "1 when a scheduler cycle finished in the last 15 s (on any instance).",
        value=1 if running else 0,
    )
    family = GaugeMetricFamily(
        "heteroflow_periodic_job_last_success_timestamp_seconds",
        "When each periodic job last finished without failing (Unix time; the latest host for per-host jobs).",
        labels=["job"],
    )
    latest = {}
    for key, finished_at, outcome in selectors.job_runs():
        if finished_at is None or outcome != "ran":
            continue
        job = job_label(key)
        latest[job] = max(latest.get(job, 0.0), finished_at.timestamp())
    for job, at in sorted(latest.items()):
        family.add_metric([job], at)
    yield family


def gateway_part(now):
    """Requests in flight per backend over every gateway process: the least-connections
    counts the gateway keeps in Redis (apps.gateway.limits), read at scrape time like the
    rest of the snapshot, so every instance reports the same."""
    family = GaugeMetricFamily(
        "heteroflow_gateway_backend_in_flight",
        "Requests in flight to each gateway backend (a replica's or an external backend's address), "
        "over every gateway process; a backend with none is left out.",
        labels=["backend"],
    )
    for backend, count in sorted(backend_in_flight(redis_client(), now.timestamp()).items()):
        family.add_metric([backend], count)
    yield family


QUEUE_GAUGES = (
    ("nominal", "Cards guaranteed to the tenant (its queue's nominal)."),
    ("used", "Cards the tenant holds (a shared card as its share)."),
    ("borrowed", "Cards the tenant holds above its nominal, lent by its cohort."),
    ("lent", "Of the tenant's idle nominal, what its cohort's borrowers use."),
)


def queues_part(now):
    """Per tenant with a queue and GPU type: nominal, used, borrowed and lent cards
    (docs/queues.md), as GET /api/v1/admin/queues answers them."""
    book = quotas.queue_book(now)
    families = {
        name: GaugeMetricFamily(f"heteroflow_queue_{name}_gpus", words, labels=["tenant", "gpu_type"])
        for name, words in QUEUE_GAUGES
    }
    for tenant_id in sorted(book.specs):
        view = quotas.tenant_view(book, tenant_id)
        for row in view["types"]:
            for name, family in families.items():
                family.add_metric([view["tenant"], gpu_type_label(row["gpu_type"])], float(row[name]))
    yield from families.values()


SNAPSHOT_PARTS = (
    ("nodes", nodes_part),
    ("gpus", gpus_part),
    ("alerts", alerts_part),
    ("queue", queue_part),
    ("scheduler", scheduler_part),
    ("gateway", gateway_part),
    ("queues", queues_part),
)


class ClusterSnapshot:
    def __init__(self, parts=SNAPSHOT_PARTS):
        self.parts = parts

    def collect(self):
        now = utcnow()
        families, done = [], {}
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT set_config('statement_timeout', %s, true)", [str(SNAPSHOT_STATEMENT_TIMEOUT_MS)]
                    )
                for name, part in self.parts:
                    try:
                        with transaction.atomic():
                            computed = list(part(now))
                    except Exception:
                        logger.warning("metrics snapshot: %s could not be computed; left out", name, exc_info=True)
                        done[name] = 0
                    else:
                        families += computed
                        done[name] = 1
        except Exception:
            logger.warning("metrics snapshot: no database; the cluster gauges are left out", exc_info=True)
        up = GaugeMetricFamily(
            "heteroflow_metrics_snapshot_up",
            "1 when this part of the cluster snapshot was computed for this scrape.",
            labels=["part"],
        )
        for name, _part in self.parts:
            up.add_metric([name], done.get(name, 0))
        return [*families, up]


class Exposition:
    def __init__(self, *, snapshot: bool):
        self.snapshot = snapshot

    def collect(self):
        yield from process_group_metrics()
        if self.snapshot:
            yield from ClusterSnapshot().collect()


WEB = Exposition(snapshot=True)
PROCESS_GROUP = Exposition(snapshot=False)


def render(exposition: Exposition, accept: str = "") -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept or "")
    return encoder(exposition), content_type
