"""Fixtures for the image channel's tests: a real registry (scripts/registry.sh: Debian's
distribution registry, seeded with small busybox images) and a real engine
(scripts/container-engine.sh: Podman's Docker API service, started after the registry so
it trusts it). Without them the tests skip saying why; in CI (.ci/run sets
HETEROFLOW_REQUIRE_REGISTRY=1) a missing registry or engine fails them instead."""

from __future__ import annotations

import os

import pytest
import requests

HOW_TO = (
    'start them with: eval "$(scripts/registry.sh --install start)"; '
    'eval "$(scripts/container-engine.sh --install start)" (the registry first)'
)


def _missing(why: str):
    if os.environ.get("HETEROFLOW_REQUIRE_REGISTRY") == "1":
        pytest.fail(f"HETEROFLOW_REQUIRE_REGISTRY=1 but {why} ({HOW_TO})")
    pytest.skip(f"{why} ({HOW_TO})")


@pytest.fixture(scope="session")
def image_registry() -> str:
    """127.0.0.1:PORT of the test registry, after checking it serves the seeded images."""
    address = os.environ.get("HETEROFLOW_TEST_REGISTRY")
    if not address:
        _missing("no test registry: HETEROFLOW_TEST_REGISTRY is unset")
    try:
        tags = requests.get(f"http://{address}/v2/heteroflow/probe/tags/list", timeout=5).json().get("tags") or []
    except (requests.RequestException, ValueError) as exc:
        _missing(f"the test registry at {address} does not answer: {exc}")
    if not {"1.0", "2.0", "latest"} <= set(tags):
        _missing(f"the test registry at {address} lacks heteroflow/probe:1.0/2.0/latest (it has {tags})")
    return address


@pytest.fixture(scope="session")
def image_engine(image_registry):
    """The docker SDK client of the engine named by DOCKER_HOST."""
    if not os.environ.get("DOCKER_HOST"):
        _missing("no container engine: DOCKER_HOST is unset")
    try:
        import docker

        client = docker.from_env(timeout=60)
        client.ping()
    except Exception as exc:
        _missing(f"the container engine at {os.environ['DOCKER_HOST']} does not answer: {exc}")
    yield client
    client.close()


def remove_test_images(engine, registry: str) -> None:
    for image in engine.images.list():
        for tag in image.attrs.get("RepoTags") or []:
            if tag.startswith(f"{registry}/heteroflow/"):
                try:
                    engine.images.remove(tag, force=True)
                except Exception:
                    pass


@pytest.fixture
def clean_engine(image_engine, image_registry):
    """The engine without any of the registry's test images, before and after the test."""
    remove_test_images(image_engine, image_registry)
    yield image_engine
    remove_test_images(image_engine, image_registry)
