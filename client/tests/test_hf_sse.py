"""Following a log: the event-stream parser, and a follower that loses its connection
(mid-event, or the whole server for a while) and goes on from the last line it has, with
Last-Event-ID and after=, so that no line is lost or repeated; and the old server's
answer (the final log tail), which a follower waits out."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from hf_fakeapi import KEY, Answer, FakeAPI, end_chunks, line, lines_event, send_chunk, start_events, streaming

from heteroflow_client.logs import Backoff, Follower, SSEParser, read_page
from heteroflow_client.transport import Transport
from heteroflow_client.types import LogEnd, LogLine

PATH = "/api/v1/tasks/1/logs"
TOTAL = 20


def test_the_parser_joins_chunks_and_reads_every_field():
    parser = SSEParser()
    stream = (
        ": keepalive\n\n"
        'event: lines\nid: 2\ndata: {"lines": [1,\ndata: 2]}\n\n'
        "data: plain\r\n\r\n"
        "retry: 1500\nevent: end\ndata: {}\n\n"
    )
    events = []
    for i in range(0, len(stream), 3):  # three characters at a time: boundaries everywhere
        events += parser.feed(stream[i : i + 3])
    assert [(e.type, e.data, e.id) for e in events] == [
        ("lines", '{"lines": [1,\n2]}', "2"),
        ("message", "plain", "2"),  # the id carries over, as the standard says
        ("end", "{}", "2"),
    ]
    assert parser.retry_ms == 1500


def test_a_half_crlf_at_a_chunk_end_is_not_an_empty_line():
    parser = SSEParser()
    assert parser.feed("data: x\r") == []
    assert [e.data for e in parser.feed("\n\r\n")] == ["x"]


class Stream:
    """A log of TOTAL lines served as events, two lines an event; each connection is cut
    (mid-event) after `per_connection` lines until the last, which sends the end."""

    def __init__(self, api: FakeAPI, per_connection: int = 6, overlap: int = 0, event: str = "lines"):
        self.per_connection = per_connection
        self.overlap = overlap  # a server that re-sends lines the client has (it must drop them)
        self.event = event
        self.asks: list[tuple[str, str]] = []  # (after=, Last-Event-ID) of each connection
        api.route("GET", PATH, streaming(self.serve))

    def serve(self, request, match, http):
        after = int(request.query.get("after", 0))
        self.asks.append((request.query.get("after"), request.headers.get("last-event-id")))
        start_events(http)
        send_chunk(http, ": keepalive\n\n")
        first = max(1, after + 1 - self.overlap)
        last = min(TOTAL, after + self.per_connection)
        seq = first
        while seq <= last:
            batch = [line(s) for s in range(seq, min(seq + 2, last + 1))]
            send_chunk(http, lines_event(batch, self.event))
            seq += 2
        if last < TOTAL:
            # half an event, then the connection is gone (no closing chunk)
            send_chunk(http, lines_event([line(last + 1)], self.event)[:25])
            http.wfile.flush()
            http.connection.shutdown(socket.SHUT_RDWR)
            http.close_connection = True
            return
        send_chunk(http, "event: end\ndata: " + json.dumps({"status": "failed", "exit_code": 3}) + "\n\n")
        end_chunks(http)


def follow(api_url: str, **options) -> tuple[list, Follower]:
    transport = Transport(api_url, KEY, retries=0)
    follower = Follower(transport, PATH, backoff=Backoff(0.05, 0.2), **options)
    return list(follower), follower


def test_a_cut_stream_resumes_after_the_last_line_with_nothing_lost_or_repeated(fakeapi):
    stream = Stream(fakeapi)
    items, follower = follow(fakeapi.url)
    lines = [item for item in items if isinstance(item, LogLine)]
    assert [item.seq for item in lines] == list(range(1, TOTAL + 1))
    assert [item.text for item in lines][:2] == ["line 1", "line 2"]
    assert items[-1] == LogEnd(status="failed", exit_code=3)
    # every reconnection asked from the last line it had, both ways
    assert stream.asks == [("0", None), ("6", "6"), ("12", "12"), ("18", "18")]
    assert follower.reconnects == 3


def test_lines_a_server_sends_again_are_dropped(fakeapi):
    Stream(fakeapi, per_connection=5, overlap=3, event="")  # unnamed events: "message"
    items, _ = follow(fakeapi.url)
    assert [item.seq for item in items if isinstance(item, LogLine)] == list(range(1, TOTAL + 1))


def test_a_follower_outlives_a_restart_of_the_server(fakeapi):
    stream = Stream(fakeapi, per_connection=8)
    port = fakeapi.server.server_address[1]
    replacement = {}

    def restart():
        # the first connection is cut, and the server is away for a second
        deadline = time.monotonic() + 10
        while not stream.asks and time.monotonic() < deadline:
            time.sleep(0.01)
        fakeapi.close()
        time.sleep(1.0)
        api = FakeAPI(port)
        replacement["api"] = api
        replacement["stream"] = Stream(api, per_connection=8)

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        items, follower = follow(fakeapi.url)
    finally:
        thread.join()
        replacement["api"].close()
    assert [item.seq for item in items if isinstance(item, LogLine)] == list(range(1, TOTAL + 1))
    assert replacement["stream"].asks[0] in (("8", "8"), ("16", "16"))


def test_a_server_before_the_live_logs_is_waited_out_and_its_tail_given_once(fakeapi):
    answers = [
        {"task_id": 1, "status": "pending", "log_tail": ""},
        {"task_id": 1, "status": "running", "log_tail": ""},
        {"task_id": 1, "status": "completed", "log_tail": "hello\nworld\n"},
    ]
    fakeapi.route("GET", PATH, lambda request, match: Answer(200, answers.pop(0) if len(answers) > 1 else answers[0]))
    seen = []
    transport = Transport(fakeapi.url, KEY)
    follower = Follower(transport, PATH, poll_interval=0.01, on_status=seen.append)
    items = list(follower)
    assert [(i.seq, i.text) for i in items if isinstance(i, LogLine)] == [(1, "hello"), (2, "world")]
    assert items[-1] == LogEnd(status="completed", exit_code=None)
    assert seen == ["pending", "running", "completed"]
    page = read_page(transport, PATH, tail=1)
    assert [line.text for line in page.lines] == ["world"] and not page.live


def test_a_page_of_the_live_api_gives_its_lines_and_next(fakeapi):
    fakeapi.route(
        "GET",
        PATH,
        lambda request, match: Answer(
            200, {"lines": [line(7), line(8)], "next": 8, "status": "running", "exit_code": None}
        ),
    )
    page = read_page(Transport(fakeapi.url, KEY), PATH, after=6)
    assert [line.seq for line in page.lines] == [7, 8] and page.next == 8 and page.live
    assert fakeapi.got("GET", PATH)[-1].query == {"after": "6"}


@pytest.mark.parametrize("status", [401, 404])
def test_a_refusal_is_not_retried(fakeapi, status):
    from heteroflow_client.errors import AuthError, NotFound

    fakeapi.route("GET", PATH, lambda request, match: Answer(status, {"error": {"code": "x", "message": "no"}}))
    with pytest.raises(AuthError if status == 401 else NotFound):
        follow(fakeapi.url)
    assert len(fakeapi.got("GET", PATH)) == 1
