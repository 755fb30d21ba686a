"""What the gateway gathered is written: at shutdown (a real control plane process under
uvicorn, a real SIGTERM) and every HETEROFLOW_GATEWAY_FLUSH_SECONDS with no request to
trigger it, so a SIGKILL loses at most that long's worth; and a pooled connection the
database ended fails no request."""

from __future__ import annotations

import signal

import pytest
import requests
from django.db import connection
from django.db.models import Sum

from apps.gateway.catalog import APPLICATION_NAME
from apps.gateway.models import UsageBucket
from tests.live import start_control_plane, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}


def post(url: str, key: str, **extra) -> requests.Response:
    return requests.post(
        f"{url}/v1/chat/completions", json=BODY | extra, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def totals(key_row) -> dict:
    return UsageBucket.objects.filter(key=key_row).aggregate(
        requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )


def test_sigterm_writes_the_usage_of_every_request(upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key()
    # no periodic flush in this process's lifetime: only the shutdown can write the rows
    plane, url = start_control_plane(env={"HETEROFLOW_GATEWAY_FLUSH_SECONDS": "600"})
    try:
        statuses = [post(url, key).status_code for _ in range(20)]
        statuses += [post(url, key, stream=True, max_tokens=2).status_code for _ in range(5)]
        assert statuses == [200] * 25
        assert totals(row)["requests"] is None  # nothing written yet
        stop_process(plane, signal.SIGTERM)
    finally:
        stop_process(plane, signal.SIGKILL)
    # 20 answers with their usage (7 + 3), 5 streams without one (one token per event)
    assert totals(row) == {"requests": 25, "prompt": 20 * 7, "completion": 20 * 3 + 5 * 2}


def test_usage_is_written_within_the_flush_period_with_no_request_after_it(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key()
    # back to back: whichever flush the first one's end starts, the second is left in memory
    # until the next period
    assert [post(gateway.url, key).status_code for _ in range(2)] == [200, 200]
    wait_until(lambda: totals(row)["requests"] == 2, 15, "the usage written by the periodic flush")


def test_a_connection_the_database_ended_fails_no_request(gateway, upstreams, tenancy, settings):
    settings.HETEROFLOW_GATEWAY_FLUSH_SECONDS = 600  # no flush meets the dead connection first
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    assert post(gateway.url, key).status_code == 200  # the route's pool holds a connection now
    gateway.call(gateway.app.meter.flush())
    gateway.app.catalog.clear()  # the next request reads the key and the routes again
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            [APPLICATION_NAME],
        )
        assert cursor.fetchone()[0] >= 1
    response = post(gateway.url, key)
    assert response.status_code == 200, response.text
