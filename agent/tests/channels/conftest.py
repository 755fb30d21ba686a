"""Slice tests run the agent's real tool calls against stateful stand-ins (see
agent/tests/slicing_host.py) and its real HTTP against the scripted server."""

from __future__ import annotations

import pytest
from agent.tests.slicing_host import Cards

from heteroflow_agent.client import ServerClient


@pytest.fixture
def cards(tmp_path, monkeypatch) -> Cards:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    return Cards(tmp_path)


@pytest.fixture
def client(server):
    made = ServerClient(server.url, "k", attempts=1, sleep=lambda s: None)
    yield made
    made.close()
