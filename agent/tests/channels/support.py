"""Helpers for the image channel's tests (agent/tests/channels and
tests/faults/test_image_channel.py): the real registry and engine they need, and a
registry that stalls."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import requests

HOW_TO = (
    'start them with: eval "$(scripts/registry.sh --install start)"; '
    'eval "$(scripts/container-engine.sh --install start)" (the registry first)'
)


def missing(why: str):
    """Skip, saying why; in CI (HETEROFLOW_REQUIRE_REGISTRY=1, set by .ci/run) fail instead."""
    if os.environ.get("HETEROFLOW_REQUIRE_REGISTRY") == "1":
        pytest.fail(f"HETEROFLOW_REQUIRE_REGISTRY=1 but {why} ({HOW_TO})")
    pytest.skip(f"{why} ({HOW_TO})")


def require_registry() -> str:
    """127.0.0.1:PORT of the test registry, after checking it serves the seeded images."""
    address = os.environ.get("HETEROFLOW_TEST_REGISTRY")
    if not address:
        missing("no test registry: HETEROFLOW_TEST_REGISTRY is unset")
    try:
        tags = requests.get(f"http://{address}/v2/heteroflow/probe/tags/list", timeout=5).json().get("tags") or []
    except (requests.RequestException, ValueError) as exc:
        missing(f"the test registry at {address} does not answer: {exc}")
    if not {"1.0", "2.0", "latest"} <= set(tags):
        missing(f"the test registry at {address} lacks heteroflow/probe:1.0/2.0/latest (it has {tags})")
    return address


def require_engine():
    """The docker SDK client of the engine named by DOCKER_HOST."""
    if not os.environ.get("DOCKER_HOST"):
        missing("no container engine: DOCKER_HOST is unset")
    try:
        import docker

        client = docker.from_env(timeout=60)
        client.ping()
    except Exception as exc:
        missing(f"the container engine at {os.environ['DOCKER_HOST']} does not answer: {exc}")
    return client


def remove_test_images(engine, registry: str) -> None:
    for image in engine.images.list():
        for tag in image.attrs.get("RepoTags") or []:
            if tag.startswith(f"{registry}/heteroflow/"):
                try:
                    engine.images.remove(tag, force=True)
                except Exception:
                    pass


class StallingRegistry:
    """A 'registry' that accepts connections, reads what comes, and never answers, until
    release() closes every connection."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.received = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn):
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.received += len(data)

    def release(self):
        self.sock.close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
