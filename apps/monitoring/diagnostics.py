"""Runtime internals of the process that answers: for operators chasing a leak, a stuck
thread or an exhausted pool. Internal variables rather than aggregates, hence
operators only (unlike /metrics)."""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading
import time

import django
import psutil
from django.conf import settings
from django.db import connection

from apps.monitoring.exposition import multiprocess_dir


def _pool_stats(pool) -> dict | None:
    if pool is None:
        return None
    try:
        return dict(pool.get_stats())
    except Exception:
        return None


def heartbeat_pool_stats() -> dict | None:
    """The heartbeat route's own pool, when this process serves it (ASGI)."""
    asgi = sys.modules.get("heteroflow.asgi")
    application = getattr(asgi, "application", None)
    return _pool_stats(getattr(application, "_pool", None))


def runtime_facts() -> dict:
    process = psutil.Process()
    with process.oneshot():
        memory = process.memory_info()
        cpu = process.cpu_times()
        created = process.create_time()
        try:
            open_files = process.num_fds()
        except (AttributeError, psutil.Error):
            open_files = None
        threads_os = process.num_threads()
    path = multiprocess_dir()
    return {
        "pid": os.getpid(),
        "started_at": created,
        "uptime_seconds": round(time.time() - created, 1),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "django": django.get_version(),
        "mode": settings.HETEROFLOW_ENV,
        "memory": {"rss_bytes": memory.rss, "vms_bytes": memory.vms},
        "cpu_seconds": {"user": cpu.user, "system": cpu.system},
        "open_files": open_files,
        "threads": {"os": threads_os, "python": sorted(thread.name for thread in threading.enumerate())},
        "gc": {
            "enabled": gc.isenabled(),
            "counts": list(gc.get_count()),
            "thresholds": list(gc.get_threshold()),
            "generations": gc.get_stats(),
            "objects_tracked": len(gc.get_objects()),
        },
        "database_pool": _pool_stats(getattr(connection, "pool", None)),
        "heartbeat_pool": heartbeat_pool_stats(),
        "metrics": {
            "multiprocess_dir": path,
            "multiprocess_files": len(os.listdir(path)) if path and os.path.isdir(path) else None,
        },
    }
