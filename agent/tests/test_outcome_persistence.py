"""Undelivered outcomes survive an agent restart: the executor keeps them in its data
directory (heteroflow_agent.outcomes), and the next agent process loads them and
delivers them at its first reconcile, without taking their tasks for lost. The file is
written atomically, bounded, and a corrupt one is set aside and logged."""

import json
import logging
import os
import stat

import pytest
from agent.tests.waiting import wait_for

from heteroflow_agent import delivery, outcomes
from heteroflow_agent.client import ServerClient
from heteroflow_agent.delivery import Outcome
from heteroflow_agent.executor import Executor
from heteroflow_agent.reconcile import Reconciler
from heteroflow_agent.runtime import TaskSpec
from heteroflow_agent.runtime.process import ProcessRuntime


@pytest.fixture
def runtime(tmp_path):
    made = ProcessRuntime(tmp_path / "tasks")
    yield made
    for task_id, _state in made.tasks().items():
        made.stop(task_id, 1)
        made.remove(task_id)


def executor_for(server, runtime, state_dir):
    client = ServerClient(server.url, "k", attempts=1, sleep=lambda s: None)
    return Executor("n1", client, runtime, report_client=client, workers=2, watch_interval=0.1, state_dir=state_dir)


def kept_file(state_dir):
    return state_dir / outcomes.FILE_NAME


def puts(server, task_id):
    return [r["json"] for r in server.requests if r["method"] == "PUT" and r["path"] == f"/api/v1/tasks/{task_id}"]


def test_an_outcome_kept_by_one_agent_process_is_delivered_by_the_next(server, runtime, tmp_path):
    state = tmp_path / "state"
    runtime.start(TaskSpec(task_id=9, image="", command=["true"]))
    assert wait_for(lambda: not runtime.state(9).running)
    first = executor_for(server, runtime, state)
    server.answer("/api/v1/tasks/9", (503, {}))
    outcome = Outcome(9, "running", "failed", 3, "exited with code 3", "the last lines\n" * 10, attempt=2)
    assert not first.deliver(outcome)
    assert kept_file(state).exists()
    first.close()  # the agent stops (or dies): its memory is gone

    second = executor_for(server, runtime, state)
    assert list(second.undelivered) == [9] and second.undelivered[9] == outcome
    server.answer("/api/v1/tasks/9", (200, {}))
    assert Reconciler(second).run_once()["redelivered"] == [9]
    delivered = puts(server, 9)
    assert delivered[0] == delivered[1]  # the same report as the first agent's attempt
    assert (delivered[1]["status"], delivered[1]["exit_code"], delivered[1]["attempt"]) == ("failed", 3, 2)
    assert delivered[1]["log_tail"] == "the last lines\n" * 10
    assert 9 not in runtime.tasks()  # removed once the server has it
    assert not kept_file(state).exists()  # nothing left to keep
    second.close()
    assert not executor_for(server, runtime, state).undelivered  # a third start has nothing to send


def test_a_kept_task_is_not_taken_for_lost_while_its_outcome_waits(server, runtime, tmp_path):
    """The server still has the task running (it has not got the outcome), and nothing for
    it is left on this node: the reconciler must not report it lost, only try the outcome."""
    state = tmp_path / "state"
    first = executor_for(server, runtime, state)
    server.answer("/api/v1/tasks/12", (503, {}))
    assert not first.deliver(Outcome(12, "running", "completed", 0, "", "done"))
    first.close()
    second = executor_for(server, runtime, state)
    server.answer("/api/v1/tasks/12", (503, {}))  # the redelivery fails again
    server.answer("/api/v1/tasks", (200, {"results": [{"id": 12, "status": "running"}]}))
    done = Reconciler(second).run_once()
    assert (done["redelivered"], done["lost"]) == ([], [])
    assert not any(r["path"].endswith("/container-lost") for r in server.requests)
    assert 12 in second.undelivered and kept_file(state).exists()  # still kept, for the next pass
    second.close()


def test_the_kept_outcomes_are_bounded_oldest_given_up_first(server, runtime, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(delivery, "MAX_UNDELIVERED", 3)
    state = tmp_path / "state"
    first = executor_for(server, runtime, state)
    for task_id in range(1, 6):
        server.answer(f"/api/v1/tasks/{task_id}", (503, {}))
        assert not first.deliver(Outcome(task_id, "running", "completed", 0, "", "x" * 100_000))
    first.close()
    document = json.loads(kept_file(state).read_text())
    assert [entry["task_id"] for entry in document["outcomes"]] == [3, 4, 5]
    assert all(len(entry["log_tail"]) == outcomes.LOG_TAIL_MAX for entry in document["outcomes"])  # as reported
    assert list(executor_for(server, runtime, state).undelivered) == [3, 4, 5]
    # a file holding more than the bound (written by a build with a larger one) is cut on load
    document["outcomes"] = [dict(document["outcomes"][0], task_id=i) for i in range(10, 16)]
    kept_file(state).write_text(json.dumps(document))
    with caplog.at_level(logging.ERROR, logger="heteroflow_agent.outcomes"):
        assert list(executor_for(server, runtime, state).undelivered) == [13, 14, 15]
    assert "the oldest 3 are given up" in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b'{"format": 99, "outcomes": []}',
        b'{"format": 1, "outcomes": {"9": {}}}',
        b"",
    ],
)
def test_a_corrupt_file_is_set_aside_and_logged_and_the_agent_starts(server, runtime, tmp_path, caplog, content):
    state = tmp_path / "state"
    state.mkdir()
    kept_file(state).write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="heteroflow_agent.outcomes"):
        started = executor_for(server, runtime, state)
    assert not started.undelivered
    assert "cannot be read" in caplog.text
    aside = state / (outcomes.FILE_NAME + ".corrupt")
    assert aside.read_bytes() == content and not kept_file(state).exists()  # kept for a person to look at
    server.answer("/api/v1/tasks/4", (503, {}))
    assert not started.deliver(Outcome(4, "running", "completed", 0))
    assert [e["task_id"] for e in json.loads(kept_file(state).read_text())["outcomes"]] == [4]  # a fresh file
    started.close()


def test_a_bad_entry_is_skipped_and_the_others_are_delivered(server, runtime, tmp_path, caplog):
    state = tmp_path / "state"
    state.mkdir()
    good = {"task_id": 5, "from_status": "running", "status": "completed", "exit_code": 0, "log_tail": "ok"}
    bad = [
        {"task_id": "5", "from_status": "running", "status": "completed"},
        {"task_id": True, "from_status": "running", "status": "completed"},
        {"task_id": 6, "status": "completed"},
        {"task_id": 7, "from_status": "running", "status": "failed", "exit_code": "3"},
        "not an object",
    ]
    kept_file(state).write_text(json.dumps({"format": 1, "outcomes": [*bad, good]}))
    with caplog.at_level(logging.ERROR, logger="heteroflow_agent.outcomes"):
        started = executor_for(server, runtime, state)
    assert list(started.undelivered) == [5]
    assert started.undelivered[5] == Outcome(5, "running", "completed", 0, "", "ok")
    assert "5 kept outcome(s) could not be read" in caplog.text
    started.close()


def test_the_file_is_replaced_atomically_and_private(tmp_path, monkeypatch):
    store = outcomes.OutcomeStore(tmp_path / "state", limit=10)
    first = [{"task_id": 1, "from_status": "running", "status": "completed", "exit_code": 0}]
    assert store.save(lambda: first)
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600  # log tails may hold private output
    before = store.path.read_bytes()

    def power_cut(source, target):
        raise OSError("no space left on device")

    monkeypatch.setattr(outcomes.os, "replace", power_cut)
    assert not store.save(lambda: [*first, {"task_id": 2, "from_status": "running", "status": "failed"}])
    assert store.path.read_bytes() == before  # the old list, whole
    assert [p.name for p in store.path.parent.iterdir()] == [outcomes.FILE_NAME]  # no temporary left behind
    monkeypatch.undo()
    assert [o["task_id"] for o in store.load()] == [1]


def test_an_unwritable_state_dir_keeps_the_outcome_in_memory(server, runtime, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    started = executor_for(server, runtime, blocked / "state")
    server.answer("/api/v1/tasks/8", (503, {}))
    with caplog.at_level(logging.ERROR, logger="heteroflow_agent.outcomes"):
        assert not started.deliver(Outcome(8, "running", "completed", 0))
    assert 8 in started.undelivered  # still delivered by this process's reconciler
    assert "an agent restart would lose them" in caplog.text
    started.close()


def test_without_a_state_dir_nothing_is_written(server, runtime, tmp_path):
    client = ServerClient(server.url, "k", attempts=1, sleep=lambda s: None)
    started = Executor("n1", client, runtime, report_client=client, workers=2)
    server.answer("/api/v1/tasks/3", (503, {}))
    assert not started.deliver(Outcome(3, "running", "completed", 0))
    assert started.outcome_store is None and 3 in started.undelivered
    started.close()
