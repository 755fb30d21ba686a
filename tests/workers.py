"""Each pytest-xdist worker gets data stores of its own (`make test` runs the suite on
several workers, README.md#tests).

Loaded as a plugin (`-p tests.workers` in pytest.ini), so this module runs before
pytest-django reads the settings, and every process a test starts inherits what it sets:
- PostgreSQL: pytest-django already gives each worker its own test database
  (`test_<name>_gw0`…); nothing to do here;
- Redis: worker N uses database (base + N) mod 16 of the same server, so one worker's
  Celery queue, limits and caches are never another's;
- the data folder: `<HETEROFLOW_DATA_DIR>/gwN`, for what tests write there (the agent
  installer's files, metrics folders).
Without xdist (PYTEST_XDIST_WORKER unset) nothing changes.

It also decides which tests share a worker (`--dist loadgroup`): a test module's tests
stay together, as with `--dist loadfile` (module fixtures are built once: the two-tenant
world, a module's control plane), and the modules that drive the one container engine
run one after another on one worker (`CONTAINER_ENGINE_MODULES`): an agent's reconcile
removes the managed containers it does not know, and task ids (container names) repeat
between the workers' databases.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDIS_DATABASES = 16  # a Redis server's default `databases`
CONTAINER_ENGINE_GROUP = "container-engine"
CONTAINER_ENGINE_MODULES = (
    "agent/tests/runtime/",
    "agent/tests/channels/test_image_channel.py",
    "tests/faults/test_image_channel.py",
    "tests/tasks/test_agent_executor_e2e.py",
)


def worker_group(nodeid: str) -> str:
    """The xdist group of a test: the container engine's, else its module's."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(CONTAINER_ENGINE_MODULES):
        return CONTAINER_ENGINE_GROUP
    return module


def worker_number(worker: str) -> int:
    """gw0 -> 0, gw7 -> 7."""
    if not worker.startswith("gw") or not worker[2:].isdigit():
        raise ValueError(f"not an xdist worker id: {worker!r}")
    return int(worker[2:])


def worker_redis_url(url: str, number: int) -> str:
    """The Redis URL of worker `number`: the base URL's database moved by the number (a TCP
    URL names it in its path, a socket URL, the embedded Redis's, in `?db=`)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        base = int(query.get("db", "0"))
        query["db"] = str((base + number) % REDIS_DATABASES)
        return f"unix://{parts.path}?{urlencode(query)}"  # urlunsplit would drop the empty host's //
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


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` as this suite groups (`worker_group`): xdist's own loadgroup reads
    `xdist_group` marks by rewriting a test's node id, which pytest 9 no longer lets it do,
    so the groups are given to xdist's scope scheduler instead, which sends each group to
    one worker whole."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return SuiteGroups(config, log)
