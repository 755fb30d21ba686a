"""The reconciler with a real process runtime and a scripted control plane: adopt what
an earlier agent left, report what ended meanwhile, remove zombies only when the server
says so and only once they are a minute old, and leave everything alone when it cannot
tell."""

import threading
import time

import pytest
from agent.tests.waiting import wait_for

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


def executor_for(server, runtime):
    client = ServerClient(server.url, "k", attempts=1, sleep=lambda s: None)
    return Executor("n1", client, runtime, report_client=client, workers=2, watch_interval=0.1, stop_poll_seconds=0.2)


def start(runtime, task_id, command):
    runtime.start(TaskSpec(task_id=task_id, image="", command=command))


def test_zombies_go_only_when_the_server_says_so_and_they_are_old(server, runtime):
    for task_id in (1, 2, 3, 4):
        start(runtime, task_id, ["sleep", "300"])
    server.answer("/api/v1/tasks/1", (200, {"id": 1, "status": "completed"}))  # terminal
    server.answer("/api/v1/tasks/2", (404, {}))  # deleted, or on another node
    server.answer("/api/v1/tasks/3", (503, {}))  # cannot tell
    server.answer("/api/v1/tasks/4", (200, {"id": 4, "status": "completed"}))
    executor = executor_for(server, runtime)
    young = Reconciler(executor, clock=time.time).run_once()
    assert young["removed"] == []  # younger than a minute: left alone
    server.answer("/api/v1/tasks/1", (200, {"id": 1, "status": "completed"}))
    server.answer("/api/v1/tasks/2", (404, {}))
    server.answer("/api/v1/tasks/3", (503, {}))
    server.answer("/api/v1/tasks/4", (200, {"id": 4, "status": "completed"}))
    old = Reconciler(executor, clock=lambda: time.time() + 61).run_once()
    assert sorted(old["removed"]) == [1, 2, 4]
    assert set(runtime.tasks()) == {3} and runtime.state(3).running
    executor.close()


def test_a_task_left_running_is_adopted_and_reported_when_it_ends(server, runtime):
    start(runtime, 7, ["sh", "-c", "sleep 1; echo adopted; exit 0"])
    task = {"id": 7, "status": "running", "kind": "job", "timeout_seconds": 60}
    server.answer("/api/v1/tasks/7", *[(200, task)] * 20)
    server.answer("/api/v1/tasks/7", (200, task))
    executor = executor_for(server, runtime)
    done = Reconciler(executor).run_once()
    assert done["adopted"] == [7]
    assert wait_for(lambda: any(r["method"] == "PUT" for r in server.requests))
    report = next(r["json"] for r in server.requests if r["method"] == "PUT")
    assert (report["from_status"], report["status"], report["exit_code"]) == ("running", "completed", 0)
    assert "adopted" in report["log_tail"]
    assert "attempt" not in report  # not a group member: nothing to name
    assert wait_for(lambda: 7 not in runtime.tasks())  # removed once delivered
    executor.close()


def test_a_group_members_report_names_the_attempt_it_is_about(server, runtime):
    """The server refuses a report about an attempt that has ended (409 attempt_ended):
    the agent echoes the attempt it was handed, whether it watched or found the end."""
    start(runtime, 17, ["sh", "-c", "exit 0"])
    start(runtime, 18, ["sh", "-c", "sleep 1; exit 1"])
    assert wait_for(lambda: not runtime.state(17).running)
    ended = {"id": 17, "status": "running", "kind": "training", "attempt": 2}
    watched = {"id": 18, "status": "running", "kind": "training", "attempt": 3, "timeout_seconds": 60}
    server.answer("/api/v1/tasks/17", (200, ended), (200, {}))
    server.answer("/api/v1/tasks/18", *[(200, watched)] * 20)
    executor = executor_for(server, runtime)
    done = Reconciler(executor).run_once()
    assert done["reported"] == [17] and done["adopted"] == [18]
    assert wait_for(lambda: sum(r["method"] == "PUT" for r in server.requests) == 2)
    reports = {r["path"]: r["json"] for r in server.requests if r["method"] == "PUT"}
    assert reports["/api/v1/tasks/17"]["attempt"] == 2
    assert (reports["/api/v1/tasks/18"]["status"], reports["/api/v1/tasks/18"]["attempt"]) == ("failed", 3)
    executor.close()


def test_a_task_that_ended_while_no_agent_watched_is_reported(server, runtime):
    start(runtime, 8, ["sh", "-c", "exit 5"])
    assert wait_for(lambda: not runtime.state(8).running)
    server.answer("/api/v1/tasks/8", (200, {"id": 8, "status": "running"}))
    server.answer("/api/v1/tasks/8", (200, {}))  # the PUT
    executor = executor_for(server, runtime)
    assert Reconciler(executor).run_once()["reported"] == [8]
    report = next(r["json"] for r in server.requests if r["method"] == "PUT")
    assert (report["status"], report["exit_code"]) == ("failed", 5)
    executor.close()


def test_an_undelivered_outcome_is_kept_with_its_task_and_sent_again(server, runtime):
    start(runtime, 9, ["true"])
    assert wait_for(lambda: not runtime.state(9).running)
    executor = executor_for(server, runtime)
    server.answer("/api/v1/tasks/9", (503, {}))
    assert not executor.deliver(Outcome(9, "running", "completed", 0, "", "done"))
    assert 9 in executor.undelivered and 9 in runtime.tasks()  # kept, container too
    server.answer("/api/v1/tasks/9", (200, {}))
    assert Reconciler(executor).run_once()["redelivered"] == [9]
    assert 9 not in executor.undelivered and 9 not in runtime.tasks()
    executor.close()


def test_the_light_sweep_removes_zombies_and_adopts_nothing(server, runtime):
    start(runtime, 11, ["sleep", "300"])
    start(runtime, 12, ["sleep", "300"])
    server.answer("/api/v1/tasks/11", (200, {"id": 11, "status": "cancelled"}))
    server.answer("/api/v1/tasks/12", (200, {"id": 12, "status": "running"}))
    executor = executor_for(server, runtime)
    assert Reconciler(executor, clock=lambda: time.time() + 61).sweep_zombies() == [11]
    assert set(runtime.tasks()) == {12} and not executor.active  # not adopted by the sweep
    executor.close()


def test_the_checkpoint_decision_goes_into_the_tasks_history(server, runtime, tmp_path):
    run = tmp_path / "data" / "run"
    (run / "epoch-2").mkdir(parents=True)
    (run / "epoch-2" / ".heteroflow_complete").write_text("")
    server.answer("/api/v1/tasks/21/events", (201, {}))
    executor = executor_for(server, runtime)
    executor.volume_allow = (str(tmp_path / "data"),)
    spec = executor.spec_for(
        {
            "id": 21,
            "kind": "training",
            "checkpoint_path": "/ckpt",
            "labels": {"zone": "z1"},
            "volumes": [{"host": str(run), "container": "/ckpt"}],
        }
    )
    assert spec.env["HETEROFLOW_RESUME_FROM_CHECKPOINT"] == "/ckpt/epoch-2"
    assert spec.labels["heteroflow.label.zone"] == "z1"  # the task's labels, on its container
    event = server.requests[-1]["json"]
    assert (event["kind"], event["details"]) == ("checkpoint_resume", {"resume_from": "/ckpt/epoch-2"})
    assert "epoch-2" in event["message"]
    executor.close()


def test_a_running_task_with_nothing_here_is_reported_as_a_fact_not_failed(server, runtime):
    """The server says 21, 22 and 23 run here. 21 is held by the runtime (fine), 22 is
    being started by this agent (fine), 23 has nothing here: reported as lost, never as
    failed; the server's verdict decides."""
    start(runtime, 21, ["sleep", "300"])
    running = [{"id": 21, "status": "running"}, {"id": 22, "status": "running"}, {"id": 23, "status": "running"}]
    server.answer("/api/v1/tasks", (200, {"results": running}))
    server.answer("/api/v1/tasks/21", (200, {"id": 21, "status": "running", "kind": "job", "timeout_seconds": 60}))
    server.answer("/api/v1/tasks/23/container-lost", (200, {"task_id": 23, "verdict": "requeue", "status": "pending"}))
    executor = executor_for(server, runtime)
    executor.active[22] = threading.Event()  # claimed, image still pulling
    done = Reconciler(executor).run_once()
    assert done["lost"] == [23]
    lost = [r for r in server.requests if r["path"].endswith("/container-lost")]
    assert [(r["path"], r["json"]["node_id"]) for r in lost] == [("/api/v1/tasks/23/container-lost", "n1")]
    assert not any(r["method"] == "PUT" and r["path"] == "/api/v1/tasks/23" for r in server.requests)
    executor.active.pop(22)
    executor.close()


def test_nothing_is_reported_lost_when_the_runtime_cannot_be_listed(server, tmp_path):
    server.answer("/api/v1/tasks", (200, {"results": [{"id": 31, "status": "running"}]}))

    class Unlistable(ProcessRuntime):
        def tasks(self):
            raise OSError("engine not answering")

    executor = executor_for(server, Unlistable(tmp_path / "unlistable"))
    assert Reconciler(executor).run_once()["lost"] == []
    assert not any(r["path"].endswith("/container-lost") for r in server.requests)
    executor.close()


def test_a_container_vanishing_under_watch_is_reported_lost_and_not_failed(server, runtime):
    start(runtime, 41, ["sleep", "300"])
    task = {"id": 41, "status": "running", "kind": "job", "timeout_seconds": 60}
    server.answer("/api/v1/tasks/41", *[(200, task)] * 50)
    server.answer(
        "/api/v1/tasks/41/container-lost", (202, {"task_id": 41, "verdict": "undecided", "status": "running"})
    )
    executor = executor_for(server, runtime)
    executor.watch_adopted(task, time.time())
    runtime.stop(41, 1)
    runtime.remove(41)  # gone without a trace, as when someone removes the container by hand
    assert wait_for(lambda: any(r["path"].endswith("/container-lost") for r in server.requests))
    assert wait_for(lambda: 41 not in executor.active)
    assert not any(r["method"] == "PUT" for r in server.requests)  # no verdict of its own
    executor.close()


def test_live_task_ids_include_tasks_being_started(server, runtime):
    start(runtime, 51, ["sleep", "300"])
    executor = executor_for(server, runtime)
    executor.active[52] = threading.Event()
    assert executor.report().live_task_ids == [51, 52]
    executor.active.pop(52)
    executor.close()
