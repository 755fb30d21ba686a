"""Each pytest-xdist worker gets data stores of its own (`make test` runs the suite on
several workers, docs/deployment.md#tests).

Loaded as a plugin (`-p tests.workers` in pytest.ini), so this module runs before
pytest-django reads the settings, and every process a test starts inherits what it sets:
- PostgreSQL: pytest-django already gives each worker its own test database
  (`test_<name>_gw0`…); nothing to do here;
- Redis: worker N uses database (base + N) mod 16 of the same server, so one worker's
  Celery queue, limits and caches are never another's;
- the data folder: `<HETEROFLOW_DATA_DIR>/gwN`, for what tests write there (the agent
  installer's files, metrics folders).
Without xdist (PYTEST_XDIST_WORKER unset) nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REDIS_DATABASES = 16  # a Redis server's default `databases`


def worker_number(worker: str) -> int:
    """gw0 -> 0, gw7 -> 7."""
    if not worker.startswith("gw") or not worker[2:].isdigit():
        raise ValueError(f"not an xdist worker id: {worker!r}")
    return int(worker[2:])


def worker_redis_url(url: str, number: int) -> str:
    """The Redis URL of worker `number`: the base URL's database moved by the number."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    base = int(path) if path.isdigit() else 0
    return urlunsplit(parts._replace(path=f"/{(base + number) % REDIS_DATABASES}"))


def isolate(environ) -> None:
    worker = environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    number = worker_number(worker)
    if environ.get("REDIS_URL"):
        environ["REDIS_URL"] = worker_redis_url(environ["REDIS_URL"], number)
    if environ.get("HETEROFLOW_DATA_DIR"):
        folder = Path(environ["HETEROFLOW_DATA_DIR"]) / worker
        folder.mkdir(parents=True, exist_ok=True)
        environ["HETEROFLOW_DATA_DIR"] = str(folder)


isolate(os.environ)
