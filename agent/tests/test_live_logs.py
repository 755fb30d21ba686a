"""The live log shipper (heteroflow_agent.logs) with the real process runtime and real
tasks, against a scripted control plane on a real socket: numbering, gzip batches,
acknowledgement, resending what was not taken, the rate bound and its marker, the spool's
bound while the control plane is away, an agent restart going on where it stopped, and a
task the control plane refuses."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from agent.tests.waiting import wait_for

from heteroflow_agent.client import ServerClient
from heteroflow_agent.logs import LogShipper
from heteroflow_agent.runtime.base import TaskSpec
from heteroflow_agent.runtime.process import ProcessRuntime

NODE = "node-logs"
PATH = f"/api/v1/nodes/{NODE}/logs"


@pytest.fixture
def runtime(tmp_path):
    rt = ProcessRuntime(tmp_path / "tasks")
    yield rt
    for task_id, state in rt.tasks().items():
        if state.running:
            rt.stop(task_id, grace_seconds=0)


def shipper(server, runtime, state_dir, **kwargs) -> LogShipper:
    client = ServerClient(server.url, "k", attempts=1, connect_timeout=2, read_timeout=5)
    return LogShipper(NODE, client, runtime, state_dir, **kwargs)


def start(runtime, task_id, script):
    runtime.start(TaskSpec(task_id, "x", [sys.executable, "-c", script]))


def ended(runtime, task_id):
    wait_for(lambda: not runtime.state(task_id).running, what=f"task {task_id} to end")


def batches(server):
    return [request["json"]["tasks"] for request in server.requests if request["path"] == PATH]


def sent_lines(server, task_id):
    return [
        (line[0], line[2], line[3])
        for batch in batches(server)
        for item in batch
        if item["task_id"] == task_id
        for line in item["lines"]
    ]


def test_lines_are_numbered_sent_compressed_acknowledged_then_forgotten(server, runtime, tmp_path):
    start(runtime, 1, "import sys; print('one'); print('two', flush=True); sys.stdout.write('three')")
    ended(runtime, 1)
    logs = shipper(server, runtime, tmp_path)
    logs.track(1)
    assert logs.finish(1, wait=0) is False  # nobody has shipped yet
    server.answer(PATH, (200, {"tasks": {"1": 3}, "refused": []}))
    logs.collect()
    logs.ship()
    request = next(r for r in server.requests if r["path"] == PATH)
    assert request["headers"]["Content-Encoding"] == "gzip" and request["method"] == "POST"
    (item,) = request["json"]["tasks"]
    assert [(n, stream, text) for n, _, stream, text in item["lines"]] == [
        (0, "stdout", "one"),
        (1, "stdout", "two"),
        (2, "stdout", "three"),  # the last line had no newline: taken at the end
    ]
    assert item["dropped_bytes"] == 0 and len(item["run"]) == 16
    assert abs(item["lines"][0][1] - time.time()) < 60
    assert logs.tasks == {}  # delivered and ended: forgotten
    directory = tmp_path / "logs" / "task-1"
    assert not (directory / "spool.jsonl").exists() and not (directory / "state.json").exists()
    assert (directory / "output.log").read_text().splitlines()[2].endswith(" stdout three")  # the node's copy


def test_a_batch_not_taken_is_sent_again_with_the_same_numbers(server, runtime, tmp_path):
    start(runtime, 2, "print('a'); print('b')")
    ended(runtime, 2)
    logs = shipper(server, runtime, tmp_path)
    logs.track(2)
    logs.finish(2, wait=0)
    server.answer(PATH, (503, {"error": {"code": "unavailable"}}), (200, {"tasks": {"2": 2}, "refused": []}))
    logs.collect()
    assert logs.ship() is False and logs.failures == 1
    logs.ship()
    first, second = batches(server)
    assert first == second  # the same run and numbers: the store takes each line once
    assert logs.tasks == {} and logs.failures == 0


def test_an_answer_for_part_of_the_lines_keeps_the_rest(server, runtime, tmp_path):
    start(runtime, 3, "print('a'); print('b'); print('c')")
    ended(runtime, 3)
    logs = shipper(server, runtime, tmp_path)
    logs.track(3)
    logs.finish(3, wait=0)
    # the store has a newer run of the task than this batch knows of, say: it expects 1
    server.answer(PATH, (200, {"tasks": {"3": 1}, "refused": []}), (200, {"tasks": {"3": 3}, "refused": []}))
    logs.collect()
    logs.ship()
    assert 3 in logs.tasks  # not acknowledged: still waiting
    logs.ship()
    assert [n for n, _, _ in sent_lines(server, 3)] == [0, 1, 2, 0, 1, 2] and logs.tasks == {}


def test_output_over_the_rate_is_dropped_with_a_marker_and_counted(server, runtime, tmp_path):
    start(runtime, 4, "import sys\nfor i in range(200): print('x' * 99)\nsys.stdout.flush()")
    ended(runtime, 4)
    logs = shipper(server, runtime, tmp_path, rate=2048)
    logs.track(4)
    logs.finish(4, wait=0)
    server.answer(PATH, (200, {"tasks": {"4": 999}, "refused": []}))
    logs.collect()
    logs.ship()
    (item,) = batches(server)[0]
    kept = [line for line in item["lines"] if line[2] == "stdout"]
    assert 1 <= len(kept) <= 21  # one second's worth of 100-byte lines
    assert item["dropped_bytes"] == (200 - len(kept)) * 100
    # the task ended while over the rate: the marker comes with the next line that passes,
    # here none; the count went with the batch
    assert all(line[2] != "system" for line in item["lines"])


def test_the_marker_says_how_much_was_dropped_before_the_next_line(server, runtime, tmp_path):
    script = (
        "import sys, time, os\n"
        "for i in range(50): print('y' * 99)\n"
        "sys.stdout.flush()\n"
        "while not os.path.exists('go'): time.sleep(0.02)\n"
        "print('after the burst', flush=True)\n"
    )
    start(runtime, 5, script)
    wait_for(lambda: runtime.logs_tail(5).count("y" * 99) == 50, what="the burst")
    logs = shipper(server, runtime, tmp_path, rate=1024)
    logs.track(5)
    logs.collect()
    time.sleep(1.1)  # the bucket refills
    (runtime.state_dir / "task-5" / "work" / "go").touch()
    ended(runtime, 5)
    logs.finish(5, wait=0)
    logs.collect()
    server.answer(PATH, (200, {"tasks": {"5": 999}, "refused": []}))
    logs.ship()
    lines = sent_lines(server, 5)
    marker = [text for _, stream, text in lines if stream == "system"]
    assert len(marker) == 1 and marker[0].startswith("[… ") and marker[0].endswith(" bytes dropped …]")
    assert lines[-1] == (lines[-1][0], "stdout", "after the burst") and lines[-2][1] == "system"
    assert [n for n, _, _ in lines] == list(range(len(lines)))  # numbered with no gap


def test_the_spool_is_bounded_while_the_control_plane_is_away(server, runtime, tmp_path):
    start(runtime, 6, "for i in range(300): print('%05d' % i + 'z' * 94)")
    ended(runtime, 6)
    logs = shipper(server, runtime, tmp_path, rate=1 << 30, spool_bytes=8192)
    logs.track(6)
    logs.finish(6, wait=0)
    logs.collect()
    assert logs.tasks[6].unsent() <= 8192 + 200
    server.answer(PATH, (200, {"tasks": {"6": 999}, "refused": []}))
    logs.ship()
    lines = sent_lines(server, 6)
    assert lines[-1][1] == "system" and "bytes not delivered" in lines[-1][2]
    assert lines[-2][2].startswith("00299")  # the newest kept


def test_a_restarted_agent_goes_on_where_the_last_one_stopped(server, runtime, tmp_path):
    script = (
        "import os, time\n"
        "print('before', flush=True)\n"
        "while not os.path.exists('go'): time.sleep(0.02)\n"
        "print('after', flush=True)\n"
    )
    start(runtime, 7, script)
    wait_for(lambda: "before" in runtime.logs_tail(7), what="the first line")
    first = shipper(server, runtime, tmp_path)
    first.track(7)
    server.answer(PATH, (200, {"tasks": {"7": 1}, "refused": []}))
    first.collect()
    first.ship()
    run = batches(server)[0][0]["run"]
    # the agent restarts; the task runs on
    second = shipper(server, runtime, tmp_path)
    second.resume()
    assert 7 in second.tasks and not second.tasks[7].ending
    (runtime.state_dir / "task-7" / "work" / "go").touch()
    ended(runtime, 7)
    second.finish(7, wait=0)
    server.answer(PATH, (200, {"tasks": {"7": 2}, "refused": []}))
    second.collect()
    second.ship()
    (item,) = batches(server)[1]
    assert item["run"] == run and [(n, text) for n, _, _, text in item["lines"]] == [(1, "after")]


def test_a_task_the_control_plane_refuses_is_forgotten(server, runtime, tmp_path):
    start(runtime, 8, "print('not yours')")
    ended(runtime, 8)
    logs = shipper(server, runtime, tmp_path)
    logs.track(8)
    server.answer(PATH, (200, {"tasks": {}, "refused": [8]}))
    logs.collect()
    logs.ship()
    assert logs.tasks == {}
    assert logs.finish(8, wait=0) is True


def test_the_thread_ships_about_every_second_and_finish_waits_for_delivery(server, runtime, tmp_path):
    start(runtime, 9, "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.3)\n")
    logs = shipper(server, runtime, tmp_path, ship_every=0.2)
    server.default = (200, {"tasks": {"9": 0}, "refused": []}, {})
    stop = threading.Event()
    thread = threading.Thread(target=logs.run, args=(stop,), daemon=True)
    thread.start()
    try:
        logs.track(9)
        ended(runtime, 9)
        server.default = (200, {"tasks": {"9": 3}, "refused": []}, {})
        assert logs.finish(9, wait=10) is True
    finally:
        stop.set()
        logs.wake.set()
        thread.join(5)
    assert [text for _, _, text in sent_lines(server, 9)][-3:] == ["0", "1", "2"]
    assert (tmp_path / "logs" / "task-9" / "output.log").read_text().count("\n") == 3


def test_a_control_plane_without_live_logs_is_asked_again_later_and_nothing_waits_for_it(server, runtime, tmp_path):
    start(runtime, 10, "print('a')")
    ended(runtime, 10)
    clock = [1000.0]
    logs = shipper(server, runtime, tmp_path, clock=lambda: clock[0])
    logs.track(10)
    server.answer(PATH, (404, {"error": {"code": "not_found"}}))
    logs.collect()
    logs.ship()
    assert logs.unsupported()
    assert logs.finish(10, wait=0) is False
    logs.ship()  # not sent: the ended task is let go at once, its outcome not held back
    assert logs.tasks == {} and len(batches(server)) == 1
    start(runtime, 11, "print('b')")
    ended(runtime, 11)
    logs.track(11)
    logs.collect()  # nothing read while the control plane takes none
    assert logs.tasks[11].cursor is None
    clock[0] += 601  # ten minutes on: asked again
    server.answer(PATH, (200, {"tasks": {"11": 1}, "refused": []}))
    logs.collect()
    logs.ship()
    assert [text for _, _, text in sent_lines(server, 11)] == ["b"]
