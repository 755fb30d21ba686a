"""Agent tests: no Django, no database. They import only heteroflow_agent."""

import pytest
from agent.tests.server import ScriptedServer


@pytest.fixture
def server():
    scripted = ScriptedServer()
    yield scripted
    scripted.close()
