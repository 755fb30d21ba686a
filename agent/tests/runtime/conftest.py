"""Fixtures for the runtime tests (all named docker_*: they serve the docker runtime's).
The docker runtime is tested against a real
Docker-compatible engine: `scripts/container-engine.sh start` runs one (Podman's Docker API
service) and prints the DOCKER_HOST to use; `.ci/run` does that before the suite. Without
an answering engine the engine tests skip, saying why."""

from __future__ import annotations

import itertools
import os
import secrets
import uuid

import pytest

TEST_IMAGE = os.environ.get("HETEROFLOW_TEST_IMAGE", "localhost/heteroflow-test:busybox")
RUN_LABEL = "heteroflow.test-run"
RUN_ID = uuid.uuid4().hex[:12]
# Task ids of this run (or xdist worker): large, and a random block of 1000 per run, so that
# nothing of another run or of a real agent on the same engine is ever touched.
_IDS = itertools.count(10**12 + secrets.randbelow(10**9) * 1000)

HOW_TO = 'start one with: eval "$(scripts/container-engine.sh --install start)"'


@pytest.fixture(scope="session")
def docker_engine():
    """The docker SDK client of the engine named by DOCKER_HOST; skips when there is none."""
    if not os.environ.get("DOCKER_HOST"):
        pytest.skip(f"no container engine: DOCKER_HOST is unset ({HOW_TO})")
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:
        pytest.skip(f"the container engine at {os.environ['DOCKER_HOST']} does not answer: {exc} ({HOW_TO})")
    try:
        client.images.get(TEST_IMAGE)
    except Exception as exc:
        pytest.skip(
            f"the test image {TEST_IMAGE} is not in the engine at {os.environ['DOCKER_HOST']}: {exc} ({HOW_TO})"
        )
    yield client
    # whatever this run left behind
    for container in client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={RUN_ID}"}):
        try:
            container.remove(force=True)
        except Exception:
            pass
    client.close()


@pytest.fixture
def docker_task_ids(docker_engine):
    """new_id() gives a task id unused on the engine; its container goes at teardown."""
    used: list[int] = []

    def new_id() -> int:
        task_id = next(_IDS)
        used.append(task_id)
        return task_id

    yield new_id
    for task_id in used:
        try:
            docker_engine.containers.get(f"task-{task_id}").remove(force=True)
        except Exception:
            pass


@pytest.fixture
def docker_test_labels():
    """Labels every test container carries, so the session cleans up after itself."""
    return {RUN_LABEL: RUN_ID}


@pytest.fixture(scope="session")
def docker_test_image():
    return TEST_IMAGE
