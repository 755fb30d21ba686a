"""The Celery app. Jobs live in each app's `jobs.py`; beat's schedule is built from the
periodic jobs declared there (heteroflow/beat.py).

Start a worker with `celery -A celery_worker worker`, beat with `celery -A celery_worker beat`.
"""

import gc
import os

from celery import Celery
from celery.signals import worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "heteroflow.settings")

app = Celery("heteroflow")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(related_name="jobs")

from apps.monitoring import processes  # noqa: E402

# the worker's and beat's exporters, task counters, the per-host jobs (docs/monitoring.md)
processes.install(app)


@app.on_after_finalize.connect
def _install_beat_schedule(sender, **kwargs):
    # after finalizing: Django is set up and the jobs modules (the declarations) imported
    from heteroflow.beat import beat_schedule

    sender.conf.beat_schedule = beat_schedule()


@worker_process_init.connect
def _freeze_loaded_objects(**kwargs):
    # as the web does (heteroflow/asgi.py): what a worker loaded lives as long as it, so a
    # full collection during a periodic job walks only the job's objects
    gc.freeze()
