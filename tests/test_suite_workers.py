"""How `make test` spreads the suite over pytest-xdist workers (heteroflow.launcher) and
what keeps the workers apart (tests/workers.py)."""

import pytest

from heteroflow.launcher import DEFAULT_TEST_WORKERS, with_workers
from tests.workers import CONTAINER_ENGINE_GROUP, isolate, worker_group, worker_number, worker_redis_url


def test_the_suite_runs_on_the_default_workers_a_module_to_a_worker():
    assert with_workers(["-q", "tests/nodes"], {}) == [
        "-n",
        str(DEFAULT_TEST_WORKERS),
        "--dist",
        "loadgroup",
        "-q",
        "tests/nodes",
    ]
    assert with_workers([], {"HETEROFLOW_TEST_WORKERS": "3"})[:2] == ["-n", "3"]


@pytest.mark.parametrize(
    "args",
    [
        ["-n", "2"],
        ["-n2"],
        ["--numprocesses=2"],
        ["--dist", "load"],
        ["--dist=loadfile"],
        ["-p", "no:xdist"],
        ["-pno:xdist"],
    ],
)
def test_the_callers_own_distribution_is_kept(args):
    assert with_workers(args, {}) == args


@pytest.mark.parametrize("workers", ["0", "1"])
def test_zero_or_one_worker_is_one_plain_process(workers):
    assert with_workers(["-x"], {"HETEROFLOW_TEST_WORKERS": workers}) == ["-x"]


def test_a_bad_worker_count_is_refused():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="HETEROFLOW_TEST_WORKERS"):
        with_workers([], {"HETEROFLOW_TEST_WORKERS": "many"})


@pytest.mark.parametrize(
    ("url", "number", "expected"),
    [
        ("redis://127.0.0.1:6379/15", 0, "redis://127.0.0.1:6379/15"),
        ("redis://127.0.0.1:6379/15", 2, "redis://127.0.0.1:6379/1"),
        ("redis://127.0.0.1:6379", 3, "redis://127.0.0.1:6379/3"),
        ("unix:///data/redis/redis.sock", 2, "unix:///data/redis/redis.sock?db=2"),  # the embedded Redis
        ("unix:///data/redis/redis.sock?db=15", 1, "unix:///data/redis/redis.sock?db=0"),
    ],
)
def test_each_worker_has_a_redis_database_of_its_own(url, number, expected):
    assert worker_redis_url(url, number) == expected


def test_celery_reaches_a_socket_urls_database():
    from heteroflow.settings import _celery_url

    assert _celery_url("unix:///data/redis.sock?db=3") == "redis+socket:///data/redis.sock?virtual_host=3"
    assert _celery_url("unix:///data/redis.sock") == "redis+socket:///data/redis.sock"


def test_a_worker_is_isolated_and_the_plain_run_is_left_alone(tmp_path):
    environ = {"REDIS_URL": "redis://h:1/4", "HETEROFLOW_DATA_DIR": str(tmp_path)}
    isolate(environ)
    assert environ == {"REDIS_URL": "redis://h:1/4", "HETEROFLOW_DATA_DIR": str(tmp_path)}
    environ["PYTEST_XDIST_WORKER"] = "gw3"
    isolate(environ)
    assert environ["REDIS_URL"] == "redis://h:1/7"
    assert environ["HETEROFLOW_DATA_DIR"] == str(tmp_path / "gw3") and (tmp_path / "gw3").is_dir()
    with pytest.raises(ValueError):
        worker_number("master")


def test_a_module_stays_on_one_worker_and_the_container_engine_has_one():
    assert worker_group("tests/nodes/test_drift.py::test_x[a]") == "tests/nodes/test_drift.py"
    assert worker_group("agent/tests/runtime/test_docker_runtime.py::test_y") == CONTAINER_ENGINE_GROUP
    assert worker_group("tests/tasks/test_agent_executor_e2e.py::test_z[docker]") == CONTAINER_ENGINE_GROUP
