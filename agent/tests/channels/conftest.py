"""Fixtures for the image channel's tests: a real registry (scripts/registry.sh: Debian's
distribution registry, seeded with small busybox images) and a real engine
(scripts/container-engine.sh: Podman's Docker API service, started after the registry so
it trusts it). Without them the tests skip saying why; in CI (.ci/run sets
HETEROFLOW_REQUIRE_REGISTRY=1) a missing registry or engine fails them instead."""

from __future__ import annotations

import pytest
from agent.tests.channels.support import remove_test_images, require_engine, require_registry


@pytest.fixture(scope="session")
def image_registry() -> str:
    return require_registry()


@pytest.fixture(scope="session")
def image_engine(image_registry):
    client = require_engine()
    yield client
    client.close()


@pytest.fixture
def clean_engine(image_engine, image_registry):
    """The engine without any of the registry's test images, before and after the test."""
    remove_test_images(image_engine, image_registry)
    yield image_engine
    remove_test_images(image_engine, image_registry)
