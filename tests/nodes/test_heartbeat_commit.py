"""The heartbeat's connections commit without waiting for the WAL flush (a beat is
telemetry its node's next beat writes again: docs/nodes.md), unless the operator says
`on`; the log ingestion's, whose lines the agent forgets once answered, keep the
server's default; session settings add to the database's own `options`."""

from __future__ import annotations

import asyncio

import pytest
from django.db import connections

from apps.core.db import libpq_params
from apps.nodes.api.heartbeat import HeartbeatApp
from apps.tasks.api.log_route import LogIngestApp

pytestmark = pytest.mark.django_db(transaction=True)


async def _not_found(scope, receive, send):
    raise AssertionError("not routed here")


def session_setting(app, name: str) -> str:
    async def show():
        try:
            async with (await app.pool()).connection() as conn:
                return (await (await conn.execute(f"SHOW {name}")).fetchone())[0]
        finally:
            await app.close()

    return asyncio.run(show())


@pytest.mark.parametrize("configured", ["off", "on"])
def test_the_heartbeats_connections_commit_as_configured(settings, configured):
    settings.HETEROFLOW_HEARTBEAT_SYNCHRONOUS_COMMIT = configured
    assert session_setting(HeartbeatApp(_not_found), "synchronous_commit") == configured


def test_the_log_ingestion_keeps_the_servers_synchronous_commit():
    assert session_setting(LogIngestApp(_not_found), "synchronous_commit") == "on"


def test_session_settings_come_after_the_databases_own_options(monkeypatch):
    database = connections["default"].settings_dict
    monkeypatch.setitem(database, "OPTIONS", (database.get("OPTIONS") or {}) | {"options": "-c statement_timeout=5000"})
    params = libpq_params(server_settings={"synchronous_commit": "off", "lock_timeout": "2s"})
    assert params["options"] == "-c statement_timeout=5000 -c synchronous_commit=off -c lock_timeout=2s"
