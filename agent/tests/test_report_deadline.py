"""A task's final report is bounded as a whole by `report_deadline_seconds`: against a
control plane that accepts the connection and never answers, the delivery gives up by
its deadline (each attempt's timeouts and the waits between attempts clipped to what is
left), the outcome is kept on disk, and the reconciler reports it once the control plane
answers again. A bad deadline stops the agent at start-up like any other bad setting."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import heteroflow_agent
from heteroflow_agent import outcomes
from heteroflow_agent.client import ServerClient, ServerError
from heteroflow_agent.config import ConfigError, load
from heteroflow_agent.delivery import Outcome
from heteroflow_agent.executor import Executor
from heteroflow_agent.reconcile import Reconciler
from heteroflow_agent.runtime.process import ProcessRuntime

# what a deadline may overrun by: the last attempt's socket timeout firing, and a thread
# switch on a loaded machine; far below one default read timeout (15 s)
MARGIN = 1.5


@pytest.fixture
def runtime(tmp_path):
    return ProcessRuntime(tmp_path / "tasks")


def report_client(url, deadline, **overrides):
    """The agent's own report client (6 attempts, 1 s doubling to 10 s, the default
    timeouts), with `deadline`."""
    settings = {"connect_timeout": 5.0, "read_timeout": 15.0, "attempts": 6, "backoff": 1.0, "backoff_cap": 10.0}
    return ServerClient(url, "k", deadline=deadline, **{**settings, **overrides})


def puts(server, task_id):
    return [r for r in server.requests if r["method"] == "PUT" and r["path"] == f"/api/v1/tasks/{task_id}"]


def test_a_hung_control_plane_costs_the_report_its_deadline_and_the_reconciler_delivers_it_later(
    server, runtime, tmp_path
):
    state = tmp_path / "state"
    client = ServerClient(server.url, "k", attempts=1, sleep=lambda s: None)
    executor = Executor("n1", client, runtime, report_client=report_client(server.url, 2.0), workers=1, state_dir=state)
    server.stalled.set()
    began = time.monotonic()
    assert not executor.deliver(Outcome(9, "running", "failed", 3, "exited with code 3", "the last lines\n"))
    took = time.monotonic() - began
    assert took < 2.0 + MARGIN, f"the report took {took:.1f} s against a 2 s deadline"
    assert len(puts(server, 9)) == 1  # the first attempt used the whole deadline: no second one started
    kept = outcomes.OutcomeStore(state, 10).load()
    assert [(o["task_id"], o["status"], o["exit_code"]) for o in kept] == [(9, "failed", 3)]

    server.stalled.clear()  # the control plane answers again
    server.answer("/api/v1/tasks/9", (200, {}))
    assert Reconciler(executor).run_once()["redelivered"] == [9]
    assert puts(server, 9)[-1]["json"]["status"] == "failed"
    assert not (state / outcomes.FILE_NAME).exists() and not executor.undelivered
    executor.close()


def test_a_deadline_shorter_than_one_read_timeout_clips_the_read_timeout(server):
    server.stalled.set()
    client = report_client(server.url, 1.0, read_timeout=30.0, attempts=1)
    began = time.monotonic()
    with pytest.raises(ServerError, match="ReadTimeout") as raised:
        client.request("PUT", "/api/v1/tasks/9", json={})
    assert time.monotonic() - began < 1.0 + MARGIN
    # urllib3 names the read timeout the attempt ran with: the deadline's, not the 30 s
    assert float(re.search(r"read timeout=([0-9.]+)", str(raised.value)).group(1)) <= 1.0
    clipped = client.timeout_within(0.4)
    assert (clipped.connect_timeout, clipped.total) == (0.4, 0.4)  # connecting and reading share it
    assert client.timeout_within(None) == (5.0, 30.0) == ServerClient(server.url, "k", read_timeout=30.0).timeout


class Clock:
    """Time that passes only in the client's waits, so the test reads the arithmetic."""

    def __init__(self, oversleep=0.0):
        self.now, self.waits, self.oversleep = 100.0, [], oversleep

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.waits.append(seconds)
        self.now += seconds + self.oversleep


def test_no_wait_runs_past_the_deadline_and_no_attempt_starts_after_it(server):
    server.answer("/x", *[(503, {}, {"Retry-After": "8"})] * 6)
    clock = Clock()
    client = report_client(server.url, 10.0, sleep=clock.sleep, clock=clock)
    with pytest.raises(ServerError, match="HTTP 503 after 2 attempts, at its 10 s deadline"):
        client.request("PUT", "/x", json={})
    # attempt at 0 s, wait 8 s, attempt at 8 s; a second 8 s wait would end past 10 s, so none
    assert (len(server.requests), clock.waits) == (2, [8.0])


def test_a_wait_that_oversleeps_into_the_deadline_starts_no_attempt(server):
    server.answer("/x", *[(503, {}, {"Retry-After": "8"})] * 6)
    clock = Clock(oversleep=2.5)  # a loaded machine wakes the 8 s wait at 10.5 s
    client = report_client(server.url, 10.0, sleep=clock.sleep, clock=clock)
    with pytest.raises(ServerError, match="HTTP 503 after 1 attempts, at its 10 s deadline"):
        client.request("PUT", "/x", json={})
    assert len(server.requests) == 1


def test_a_deadline_must_leave_time_for_a_call(server):
    for deadline in (0, -1.0):
        with pytest.raises(ValueError, match="leaves no time"):
            ServerClient(server.url, "k", deadline=deadline)


def test_without_a_deadline_every_attempt_is_made(server):
    server.answer("/x", *[(503, {}, {"Retry-After": "8"})] * 3)
    clock = Clock()
    client = report_client(server.url, None, attempts=3, sleep=clock.sleep, clock=clock)
    with pytest.raises(ServerError, match="HTTP 503 after 3 attempts$"):
        client.request("PUT", "/x", json={})
    assert clock.waits == [8.0, 8.0]


ENV = {"HETEROFLOW_SERVER_URL": "http://cp:3333", "HETEROFLOW_AGENT_KEY": "k", "HETEROFLOW_NODE_ID": "n1"}


def test_the_deadline_is_read_from_the_environment_and_defaults_to_a_minute():
    assert load("-", ENV).report_deadline_seconds == 60.0
    assert load("-", {**ENV, "HETEROFLOW_REPORT_DEADLINE_SECONDS": "2.5"}).report_deadline_seconds == 2.5


@pytest.mark.parametrize(
    "value, problem",
    [
        ("0", "report_deadline_seconds 0.0 is outside 1..600"),
        ("-5", "report_deadline_seconds -5.0 is outside 1..600"),
        ("601", "report_deadline_seconds 601.0 is outside 1..600"),
        ("soon", "report_deadline_seconds 'soon' is not a number"),
        ("nan", "report_deadline_seconds nan is outside 1..600"),
    ],
)
def test_a_bad_deadline_is_refused_naming_the_setting(value, problem):
    with pytest.raises(ConfigError) as raised:
        load("-", {**ENV, "HETEROFLOW_REPORT_DEADLINE_SECONDS": value})
    assert raised.value.problems == [problem]


def test_the_agent_does_not_start_with_a_bad_deadline(tmp_path):
    package_root = str(Path(heteroflow_agent.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **ENV,
        "HETEROFLOW_REPORT_DEADLINE_SECONDS": "0",
        "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
        "PYTHONPATH": package_root,
    }
    done = subprocess.run(
        [sys.executable, "-m", "heteroflow_agent", "--config", "-"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "configuration problems:\n  - report_deadline_seconds 0.0 is outside 1..600" in done.stderr
