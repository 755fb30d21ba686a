import logging
import socket

import pytest

from heteroflow_agent.client import AuthError, ServerClient, ServerError


def client(url, **kw):
    delays = []
    made = ServerClient(url, "the-key", connect_timeout=1, read_timeout=2, sleep=delays.append, **kw)
    return made, delays


def test_every_call_carries_the_agent_key(server):
    server.answer("/api/v1/agent/ping", (200, {"ok": True}))
    made, _ = client(server.url)
    assert made.request("GET", "/api/v1/agent/ping").json() == {"ok": True}
    assert server.requests[0]["headers"]["X-API-Key"] == "the-key"


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 429])
def test_transient_answers_are_retried_with_growing_delays(server, status):
    server.answer("/x", (status, {}), (status, {}), (200, {"fine": 1}))
    made, delays = client(server.url, attempts=3, backoff=0.5)
    assert made.request("GET", "/x").json() == {"fine": 1}
    assert len(server.requests) == 3 and len(delays) == 2
    assert 0.4 <= delays[0] <= 0.6 and 0.8 <= delays[1] <= 1.2


def test_retry_after_is_honoured_up_to_the_cap(server):
    server.answer("/x", (429, {}, {"Retry-After": "3"}), (503, {}, {"Retry-After": "120"}), (200, {}))
    made, delays = client(server.url, backoff_cap=8.0)
    made.request("GET", "/x")
    assert delays == [3.0, 8.0]


def test_the_retries_are_bounded(server):
    server.answer("/x", *[(503, {})] * 5)
    made, delays = client(server.url, attempts=3)
    with pytest.raises(ServerError, match="HTTP 503 after 3 attempts"):
        made.request("GET", "/x")
    assert len(server.requests) == 3 and len(delays) == 2


def test_a_401_is_never_retried_and_logged_once(server, caplog):
    server.answer("/x", *[(401, {})] * 3)
    made, delays = client(server.url)
    with caplog.at_level(logging.ERROR, logger="heteroflow_agent.client"):
        for _ in range(3):
            with pytest.raises(AuthError):
                made.request("GET", "/x")
    assert len(server.requests) == 3 and delays == []
    assert len([r for r in caplog.records if "configuration error" in r.message]) == 1


def test_client_errors_are_the_callers_to_read(server):
    server.answer("/x", (409, {"error": {"code": "status_changed"}}))
    made, delays = client(server.url)
    assert made.request("PUT", "/x", json={}).status_code == 409 and delays == []


def test_an_unreachable_server_is_retried_then_given_up():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    made, delays = client(f"http://127.0.0.1:{port}", attempts=2)
    with pytest.raises(ServerError, match="ConnectionError"):
        made.request("GET", "/x")
    assert len(delays) == 1


def test_a_server_that_does_not_answer_in_time_is_a_timeout():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        made = ServerClient(
            f"http://127.0.0.1:{silent.getsockname()[1]}",
            "k",
            connect_timeout=1,
            read_timeout=0.3,
            attempts=1,
            sleep=lambda s: None,
        )
        with pytest.raises(ServerError, match="Timeout"):
            made.request("GET", "/x")
