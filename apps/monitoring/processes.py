"""Metrics of the Celery processes, and the per-host jobs.

- worker: an exporter (HETEROFLOW_WORKER_METRICS_ADDR) in the main process, summing
  what its pool processes count (PROMETHEUS_MULTIPROC_DIR); task runs and durations.
- beat: an exporter (HETEROFLOW_BEAT_METRICS_ADDR); the ticks it sends.
- every worker consumes its host's own queue and sends the per-host periodic jobs
  (declared with `host_name`, apps.core.guard) there on its own timer, once at start and
  then every period.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from celery import bootsteps, signals
from django.conf import settings

from apps.monitoring import metrics
from apps.monitoring.hostmetrics import host_name
from heteroflow.beat import host_queue

# celery_worker imports this module before Django is set up (a worker's and beat's first
# import), so what loads models is imported inside the functions, which run later.

logger = logging.getLogger(__name__)

_started: dict[str, float] = {}
_exporters: list = []


def per_host_jobs() -> dict:
    from apps.core.guard import declared_jobs  # loads models: see the top

    return {name: job for name, job in declared_jobs().items() if job.per_host}


def own_host_queue() -> str:
    return host_queue(host_name())


def send_per_host(app, key: str, every: float) -> None:
    try:
        app.send_task(key, queue=own_host_queue(), expires=every)
    except Exception:  # the broker is away: the next period tries again
        logger.warning("could not send the per-host job %s", key, exc_info=True)


class PerHostJobs(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.entries = []

    def start(self, worker):
        for key, job in per_host_jobs().items():
            send = partial(send_per_host, worker.app, key, job.every)
            send()
            self.entries.append(worker.timer.call_repeatedly(job.every, send))

    def stop(self, worker):
        for entry in self.entries:
            entry.cancel()
        self.entries = []


def consume_own_host_queue(sender=None, instance=None, **kwargs):
    instance.app.amqp.queues.select_add(own_host_queue())


def start_exporter(setting: str, name: str, **kwargs):
    from apps.monitoring import exposition, listener  # load models: see the top

    started = listener.start(getattr(settings, setting), source=exposition.PROCESS_GROUP, name=name)
    if started is not None:
        _exporters.append(started)


def count_published(sender=None, **kwargs):
    """Connected in every Django process (MonitoringConfig.ready): web and beat publish."""
    if sender:
        metrics.CELERY_TASKS_PUBLISHED.labels(sender).inc()


def task_started(task_id=None, **kwargs):
    _started[task_id] = time.monotonic()


def task_finished(task_id=None, task=None, state=None, **kwargs):
    started = _started.pop(task_id, None)
    name = getattr(task, "name", None) or "unknown"
    metrics.CELERY_TASK_RUNS.labels(name, (state or "unknown").lower()).inc()
    if started is not None:
        metrics.CELERY_TASK_DURATION.labels(name).observe(time.monotonic() - started)


def install(app) -> None:
    app.steps["worker"].add(PerHostJobs)
    signals.celeryd_after_setup.connect(consume_own_host_queue, weak=False)
    signals.worker_ready.connect(
        partial(start_exporter, "HETEROFLOW_WORKER_METRICS_ADDR", "worker metrics"), weak=False
    )
    signals.beat_init.connect(partial(start_exporter, "HETEROFLOW_BEAT_METRICS_ADDR", "beat metrics"), weak=False)
    signals.task_prerun.connect(task_started, weak=False)
    signals.task_postrun.connect(task_finished, weak=False)
