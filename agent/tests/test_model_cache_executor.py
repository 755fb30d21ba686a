"""The executor's hook: a routed replica's model is ensured before its engine's launch is
built, the engine gets the local copy (a container also gets it mounted read-only), a
failed ensure fails the replica before anything starts, and a replica's end releases
its model for eviction."""

from __future__ import annotations

import os
import threading
import time

import pytest
from agent.tests.model_cache_support import Mirror, Reports, hub

from heteroflow_agent.client import ServerClient
from heteroflow_agent.engines.launch import process_argv
from heteroflow_agent.engines.router import LLAMACPP, EngineRouter
from heteroflow_agent.executor import Executor
from heteroflow_agent.model_cache.ensure import ModelEnsurer
from heteroflow_agent.model_cache.store import ModelStore, entry_key


class ProcessStub:
    kind = "process"


class DockerStub:
    kind = "docker"


@pytest.fixture
def mirror():
    served = Mirror()
    served.files["org/tiny"] = {"tiny.gguf": b"GGUF" + os.urandom(50_000)}
    yield served
    served.close()


def executor_on(runtime, tmp_path, mirror, reports) -> Executor:
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=runtime, workers=2, engine_python="/opt/py")
    executor.router = EngineRouter("virtual", lambda: ([LLAMACPP], {LLAMACPP: "0.3"}), runtime="process")
    executor.models = ModelEnsurer(ModelStore(tmp_path / "cache"), mirror=mirror.url, report=reports)
    return executor


def replica(serving: dict) -> dict:
    return {"id": 12, "kind": "inference", "image": "", "command": [], "host_port": 8011, "serving": serving}


def test_the_engine_is_launched_on_the_ensured_copy(tmp_path, mirror):
    executor = executor_on(ProcessStub(), tmp_path, mirror, Reports())
    task = replica(hub("org/tiny"))
    launched = executor.launched(executor.with_model(task), executor.route(task))
    local = str(tmp_path / "cache" / entry_key("hub", "org/tiny") / "tiny.gguf")
    assert launched["command"] == process_argv(LLAMACPP, "/opt/py", {**hub("org/tiny"), "source": local}, 8011)
    assert "volumes" not in launched  # a process reads it where it is
    executor.close()


def test_a_container_gets_the_ensured_copy_mounted_read_only(tmp_path, mirror):
    executor = executor_on(DockerStub(), tmp_path, mirror, Reports())
    task = {**replica(hub("org/tiny")), "volumes": [{"host": "/data/x", "container": "/x"}]}
    ensured = executor.with_model(task)
    entry = str(tmp_path / "cache" / entry_key("hub", "org/tiny"))
    assert ensured["volumes"] == [
        {"host": "/data/x", "container": "/x"},
        {"host": entry, "container": entry, "read_only": True},
    ]
    assert ensured["serving"]["source"] == entry + "/tiny.gguf"
    executor.close()


def test_a_failed_ensure_fails_the_replica_before_anything_starts(tmp_path, mirror):
    reports = Reports()
    executor = executor_on(ProcessStub(), tmp_path, mirror, reports)  # ProcessStub cannot start anything
    missing = str(tmp_path / "nowhere.gguf")
    serving = {"engine": "llama.cpp", "model": "tiny", "format": "gguf", "source_kind": "path", "source": missing}

    outcome = executor.run(replica(serving), threading.Event())

    assert outcome.status == "failed"
    assert outcome.error_message == (
        f"could not start: model tiny: path {missing} does not exist on this node (is the shared storage mounted?)"
    )
    assert reports.sent == [(12, "failed", {"model": "tiny", "message": outcome.error_message[17:]})]
    executor.close()


def test_a_replicas_end_releases_its_model(tmp_path, mirror):
    executor = executor_on(ProcessStub(), tmp_path, mirror, Reports())
    executor.with_model(replica(hub("org/tiny")))
    assert executor.models.store.in_use() == {entry_key("hub", "org/tiny")}
    executor._work(12, lambda: None)  # the worker's end, whatever the outcome
    assert executor.models.store.in_use() == set()
    executor.close()


def test_an_adopted_replica_holds_its_model_again(tmp_path, mirror):
    executor = executor_on(ProcessStub(), tmp_path, mirror, Reports())
    executor.models.ensure(12, hub("org/tiny"))
    executor.models.release(12)
    release = threading.Event()
    executor.watch = lambda task, stop, began: release.wait(10)  # held until the test lets go
    executor.watch_adopted(replica(hub("org/tiny")), None)
    assert executor.models.store.in_use() == {entry_key("hub", "org/tiny")}
    release.set()
    executor.close()
    assert executor.models.store.in_use() == set()


def test_an_agent_stopping_mid_fetch_reports_nothing_and_leaves_the_task_to_the_next(tmp_path, mirror):
    reports = Reports()
    executor = executor_on(ProcessStub(), tmp_path, mirror, reports)
    stop = threading.Event()
    stop.set()  # the agent is stopping as the first bytes arrive
    assert executor.run(replica(hub("org/tiny")), stop) is None
    assert "failed" not in reports.states()
    assert executor.models.store.in_use() == set()
    executor.close()


def test_a_replica_stopped_on_the_server_while_its_model_downloads_is_confirmed_stopped_not_started(
    tmp_path, mirror, server
):
    mirror.files["org/big"] = {"big.gguf": b"GGUF" + os.urandom(1_000_000)}
    released = threading.Event()
    mirror.hold["big.gguf"] = (300_000, released)  # a slow mirror: the download is under way
    server.default = (200, {"status": "stopping"}, {})  # the task's intent on the server
    reports = Reports()
    executor = Executor("n1", ServerClient(server.url, "k"), runtime=ProcessStub(), workers=2, engine_python="/opt/py")
    executor.stop_poll_seconds = 0.05
    executor.router = EngineRouter("virtual", lambda: ([LLAMACPP], {LLAMACPP: "0.3"}), runtime="process")
    executor.models = ModelEnsurer(ModelStore(tmp_path / "cache"), mirror=mirror.url, report=reports)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(executor.run(replica(hub("org/big")), threading.Event())))
    worker.start()
    try:
        # the watch asked the server, heard "stopping" and ended; then the bytes come again
        deadline = time.monotonic() + 10
        while not any(r["path"].startswith("/api/v1/tasks/12?") for r in server.requests):
            assert time.monotonic() < deadline, "the server was never asked"
            time.sleep(0.01)
        for thread in threading.enumerate():
            if thread.name == "fetch-watch":
                thread.join(10)
    finally:
        released.set()
        worker.join(30)
    (stopped,) = outcome
    assert (stopped.from_status, stopped.status) == ("stopping", "stopped")
    assert "failed" not in reports.states()
    part = tmp_path / "cache" / entry_key("hub", "org/big") / "big.gguf.part"
    assert part.exists() and not (part.parent / "big.gguf").exists()  # kept for a later replica
    executor.close()
