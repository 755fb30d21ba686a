"""The claim (scheduled → running) when its answer is lost: the server may have applied it
before failing (a 5xx after its commit), or the client's retry met the first try's claim
(409). Only this node's agent claims this node's tasks, so a task the server then has
running here is this agent's to run; anything else is left alone, and a lookup that fails
claims nothing (the reconciler reports such a task lost)."""

from __future__ import annotations

import threading

from heteroflow_agent.client import ServerClient
from heteroflow_agent.executor import Executor

TASK = {"id": 9, "name": "job", "image": "busybox", "command": ["true"], "gpu_required": 1, "gpu_indices": [0]}


def polled(server, claim: tuple, *lookups: tuple) -> tuple[list[int], list[int], list[dict]]:
    """One poll listing TASK, its claim answered `claim` and its lookups `lookups`: what
    the poll says it claimed, what it started, and the requests it sent for the task."""
    client = ServerClient(server.url, "k", attempts=1)
    executor = Executor("n1", client, runtime=None, vendor="nvidia", workers=1)
    started, ran = [], threading.Event()

    def run(task, stop):
        started.append(task["id"])
        ran.set()

    executor.run = run
    server.answer("/api/v1/tasks", (200, {"results": [TASK]}))
    server.answer("/api/v1/tasks/9", claim, *lookups)
    try:
        claimed = executor.poll()
        if claimed:
            ran.wait(5)
        executor.pool.shutdown(wait=True)
    finally:
        client.close()
    return claimed, started, [r for r in server.requests if r["path"].startswith("/api/v1/tasks/9")]


def test_a_claim_whose_answer_was_lost_but_landed_runs_the_task(server):
    claimed, started, sent = polled(
        server, (500, {"error": {"code": "server_error"}}), (200, TASK | {"status": "running"})
    )
    assert claimed == [9] and started == [9]
    assert [r["method"] for r in sent] == ["PUT", "GET"]
    assert "node_id=n1" in sent[1]["path"]  # the agent's lookup names the node


def test_a_409_for_a_task_running_here_is_the_retried_claims_own(server):
    claimed, started, _ = polled(
        server, (409, {"error": {"code": "status_changed"}}), (200, TASK | {"status": "running"})
    )
    assert claimed == [9] and started == [9]


def test_a_409_for_a_task_cancelled_meanwhile_starts_nothing(server):
    claimed, started, _ = polled(
        server, (409, {"error": {"code": "status_changed"}}), (200, TASK | {"status": "cancelled"})
    )
    assert claimed == [] and started == []


def test_a_task_moved_to_another_node_starts_nothing(server):
    claimed, started, _ = polled(server, (503, {}), (404, {"error": {"code": "not_found"}}))
    assert claimed == [] and started == []


def test_a_lookup_that_fails_too_claims_nothing(server):
    claimed, started, sent = polled(server, (503, {}), (503, {}))
    assert claimed == [] and started == []
    assert [r["method"] for r in sent] == ["PUT", "GET"]


def test_a_refused_claim_is_not_looked_up(server):
    claimed, started, sent = polled(server, (400, {"error": {"code": "invalid"}}))
    assert claimed == [] and started == []
    assert [r["method"] for r in sent] == ["PUT"]
