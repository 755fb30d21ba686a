"""The docker runtime against a real Docker-compatible engine (see conftest.py: without
one, every test that needs it skips with the reason). The reference and timestamp helpers
at the top need no docker_engine."""

from __future__ import annotations

import logging
import os
import time

import pytest

from heteroflow_agent.runtime import RuntimeError_, TaskSpec, Volume
from heteroflow_agent.runtime.docker import (
    MANAGED_LABEL,
    TASK_ID_LABEL,
    DockerRuntime,
    image_present,
    parse_engine_time,
    split_reference,
)


def wait_exited(runtime, task_id, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        state = runtime.state(task_id)
        if state is not None and not state.running and state.exit_code is not None:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} did not exit within {timeout} s: {state}")
        time.sleep(0.05)


def wait_running(runtime, task_id, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        state = runtime.state(task_id)
        if state is not None and state.running:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} is not running after {timeout} s: {state}")
        time.sleep(0.05)


@pytest.fixture
def runtime(docker_engine):
    """A DockerRuntime on the test engine, with pulls made small: 2 attempts of 2 s."""
    return DockerRuntime(pull_attempts=2, pull_attempt_timeout=2.0, pull_retry_delay=0.0, timeout=30)


@pytest.fixture
def run(runtime, docker_task_ids, docker_test_image, docker_test_labels):
    """run(command, **spec fields) starts a task and gives its id."""

    def start(command, **fields):
        task_id = fields.pop("task_id", None) or docker_task_ids()
        labels = {**docker_test_labels, **fields.pop("labels", {})}
        runtime.start(
            TaskSpec(
                task_id=task_id, image=fields.pop("image", docker_test_image), command=command, labels=labels, **fields
            )
        )
        return task_id

    return start


# ---- no engine needed ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("busybox", ("docker.io/library/busybox", "latest", None)),
        ("busybox:1.36", ("docker.io/library/busybox", "1.36", None)),
        ("library/busybox:1.36", ("docker.io/library/busybox", "1.36", None)),
        ("docker.io/library/busybox", ("docker.io/library/busybox", "latest", None)),
        ("index.docker.io/busybox:1", ("docker.io/library/busybox", "1", None)),
        ("lmsysorg/sglang:latest", ("docker.io/lmsysorg/sglang", "latest", None)),
        ("172.29.0.1:5000/lmsysorg/sglang", ("172.29.0.1:5000/lmsysorg/sglang", "latest", None)),
        ("localhost/heteroflow-test:busybox", ("localhost/heteroflow-test", "busybox", None)),
        ("localhost:5000/a/b/c:v1", ("localhost:5000/a/b/c", "v1", None)),
        ("registry.example.com/x@sha256:" + "a" * 64, ("registry.example.com/x", None, "sha256:" + "a" * 64)),
        ("x:1@sha256:" + "B" * 64, ("docker.io/library/x", None, "sha256:" + "b" * 64)),
    ],
)
def test_split_reference_normalizes_like_docker(reference, expected):
    assert split_reference(reference) == expected


@pytest.mark.parametrize(
    "reference", ["", " ", "a b", "x@sha256:zz", "x@@sha256:" + "a" * 64, "x:", "/x", "x//y", "x:tag;rm"]
)
def test_split_reference_refuses_what_is_no_reference(reference):
    with pytest.raises(RuntimeError_):
        split_reference(reference)


def test_image_present_matches_exactly():
    digest = "sha256:" + "c" * 64
    images = [
        {
            "RepoTags": ["172.29.0.1:5000/lmsysorg/sglang:latest", "docker.io/library/busybox:1.36"],
            "RepoDigests": [f"172.29.0.1:5000/lmsysorg/sglang@{digest}"],
        },
        {"RepoTags": ["<none>:<none>"], "RepoDigests": None},
        {"RepoTags": None, "RepoDigests": ["<none>@<none>"]},
    ]
    assert image_present("172.29.0.1:5000/lmsysorg/sglang", images)
    assert image_present(f"172.29.0.1:5000/lmsysorg/sglang@{digest}", images)
    assert image_present("busybox:1.36", images)  # Docker Hub names normalize
    # a private-registry copy is not the public image, a repository is not every tag of it
    assert not image_present("lmsysorg/sglang:latest", images)
    assert not image_present("busybox", images)  # :latest
    assert not image_present("busybox:1.3", images)
    assert not image_present(f"lmsysorg/sglang@{digest}", images)
    assert not image_present("172.29.0.1:5000/lmsysorg/sglang@sha256:" + "d" * 64, images)


def test_parse_engine_time():
    assert parse_engine_time("2026-11-29T14:54:08.146981784Z") == pytest.approx(1795964048.146981784)
    assert parse_engine_time("2026-11-29T15:54:08.5+01:00") == pytest.approx(1795964048.5)
    assert parse_engine_time("2026-11-29 14:54:08 +0000 UTC") == pytest.approx(1795964048.0)
    assert parse_engine_time("0001-01-01T00:00:00Z") is None
    assert parse_engine_time("") is None
    assert parse_engine_time(None) is None
    assert parse_engine_time("yesterday") is None


def test_credentials_go_only_to_their_registry():
    rt = DockerRuntime(base_url="unix:///nonexistent.sock")
    creds = {"registry": "https://reg.example.com:5000/", "username": "u", "password": "p"}
    auth, secret = rt._auth_for("reg.example.com:5000/team/model:1", creds)
    assert auth == {"username": "u", "password": "p", "serveraddress": "reg.example.com:5000"} and secret == "p"
    assert rt._auth_for("team/model:1", creds) == (None, None)  # Docker Hub: not theirs
    assert rt._auth_for("other.example.com/team/model:1", creds) == (None, None)
    hub = {"registry": "index.docker.io", "username": "u", "password": "p"}
    assert rt._auth_for("team/model:1", hub)[0]["serveraddress"] == "https://index.docker.io/v1/"


def test_unreachable_engine_is_unavailable_not_an_exception():
    rt = DockerRuntime(base_url="unix:///nonexistent/heteroflow.sock", timeout=2)
    ok, why = rt.available()
    assert not ok and "/nonexistent/heteroflow.sock" in why
    # and "the engine cannot say" never reads as "no such task"
    with pytest.raises(RuntimeError_):
        rt.state(1)
    with pytest.raises(RuntimeError_):
        rt.tasks()


# ---- against the engine -------------------------------------------------------------------


def test_available(runtime):
    assert runtime.available() == (True, "")
    assert runtime.kind == "docker"


def test_echo_exits_zero_with_state_and_log_tail(runtime, run):
    before = time.time()
    task_id = run(
        [
            "sh",
            "-c",
            "echo to-stderr >&2; sleep 0.2; for i in 1 2 3 4 5; do echo line$i; done; printf 'bad \\377 byte\\n'",
        ]
    )
    state = wait_exited(runtime, task_id)
    assert state.task_id == task_id and not state.running and state.exit_code == 0
    assert before - 5 <= state.started_at <= state.finished_at <= time.time() + 5
    tail = runtime.logs_tail(task_id)
    assert "line1\n" in tail and "line5\n" in tail and "to-stderr\n" in tail
    assert "bad \ufffd byte" in tail  # undecodable bytes are replaced, not fatal
    assert runtime.logs_tail(task_id, lines=2).splitlines() == ["line5", "bad \ufffd byte"]
    assert runtime.logs_tail(task_id, lines=0) == ""


def test_output_is_read_by_stream_from_a_cursor_with_no_line_twice(runtime, run, tmp_path):
    go = tmp_path / "go"
    task_id = run(
        [
            "sh",
            "-c",
            "echo out1; echo err1 >&2; echo out2; echo out3;"
            " while [ ! -e /signal/go ]; do sleep 0.05; done; echo out4; echo err2 >&2",
        ],
        volumes=(Volume(str(tmp_path), "/signal"),),
    )
    wait_for_output(runtime, task_id, "out3")
    first = runtime.read_output(task_id, None)
    by_stream = {(line.stream, line.text) for line in first.lines}
    assert by_stream == {("stdout", "out1"), ("stdout", "out2"), ("stdout", "out3"), ("stderr", "err1")}
    assert all(abs(line.at - time.time()) < 60 for line in first.lines)
    again = runtime.read_output(task_id, first.cursor)
    assert again.lines == [] and again.cursor == first.cursor  # the same second: nothing twice
    go.touch()
    wait_exited(runtime, task_id)
    rest = runtime.read_output(task_id, first.cursor)
    assert [(line.stream, line.text) for line in rest.lines] == [("stdout", "out4"), ("stderr", "err2")]
    assert runtime.read_output(task_id, rest.cursor).lines == []
    assert runtime.read_output(10**15, None).lines == []  # no such task


def test_exit_code_is_reported(runtime, run):
    task_id = run(["sh", "-c", "echo failing; exit 3"])
    state = wait_exited(runtime, task_id)
    assert state.exit_code == 3 and not state.running
    assert "failing" in runtime.logs_tail(task_id)


def test_running_state(runtime, run):
    task_id = run(["sleep", "300"])
    state = wait_running(runtime, task_id)
    assert state.exit_code is None and state.finished_at is None and state.started_at is not None


def wait_for_output(runtime, task_id, text, timeout=10.0):
    """Until the task has printed `text` (say, that its signal trap is installed)."""
    deadline = time.monotonic() + timeout
    while text not in runtime.logs_tail(task_id):
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} did not print {text!r} within {timeout} s")
        time.sleep(0.05)


def test_stop_ends_a_task_that_honours_sigterm_within_the_grace(runtime, run):
    task_id = run(["sh", "-c", "trap 'echo got-term; exit 0' TERM; echo trap-set; sleep 300 & wait"])
    wait_running(runtime, task_id)
    wait_for_output(runtime, task_id, "trap-set")
    started = time.monotonic()
    runtime.stop(task_id, grace_seconds=10)
    assert time.monotonic() - started < 5
    state = runtime.state(task_id)
    assert not state.running and state.exit_code == 0 and state.finished_at is not None
    assert "got-term" in runtime.logs_tail(task_id)


@pytest.mark.parametrize(
    "command",
    [
        ["sh", "-c", "echo trap-set; exec sleep 300"],
        ["sh", "-c", "trap '' TERM; echo trap-set; while true; do sleep 1; done"],
    ],
    ids=["sleep-as-pid-1", "traps-term"],
)
def test_stop_kills_after_the_grace(runtime, run, command):
    task_id = run(command)
    wait_running(runtime, task_id)
    wait_for_output(runtime, task_id, "trap-set")  # sleep is pid 1, or the trap is installed
    started = time.monotonic()
    runtime.stop(task_id, grace_seconds=1)
    elapsed = time.monotonic() - started
    assert 0.8 <= elapsed < 8, elapsed
    state = runtime.state(task_id)
    assert not state.running and state.exit_code == 137  # SIGKILL


def test_stop_is_idempotent_and_missing_is_fine(runtime, run, docker_task_ids):
    task_id = run(["true"])
    wait_exited(runtime, task_id)
    runtime.stop(task_id, grace_seconds=1)
    runtime.stop(task_id, grace_seconds=1)
    assert runtime.state(task_id).exit_code == 0
    runtime.stop(docker_task_ids(), grace_seconds=1)  # no such container


def test_env_workdir_and_volumes(runtime, run, tmp_path):
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "in.txt").write_text("from-host\n")
    script = (
        'echo "FOO=$FOO SPACED=$SPACED"; pwd; cat /data/ro/in.txt; echo from-container > /data/rw/out.txt; '
        "if { echo nope > /data/ro/new.txt; } 2>/dev/null; then echo ro-writable; else echo ro-refused; fi"
    )
    task_id = run(
        ["sh", "-c", script],
        env={"FOO": "bar", "SPACED": "a b=c"},
        workdir="/data/rw",
        volumes=(
            Volume(host=str(ro), container="/data/ro", read_only=True),
            Volume(host=str(rw), container="/data/rw"),
        ),
    )
    assert wait_exited(runtime, task_id).exit_code == 0
    out = runtime.logs_tail(task_id).splitlines()
    assert out == ["FOO=bar SPACED=a b=c", "/data/rw", "from-host", "ro-refused"]
    assert (rw / "out.txt").read_text() == "from-container\n"
    assert not (ro / "new.txt").exists()


def test_labels_network_and_no_auto_remove(runtime, run, docker_engine):
    task_id = run(["true"], labels={"heteroflow.model": "qwen", MANAGED_LABEL: "false", TASK_ID_LABEL: "1"})
    wait_exited(runtime, task_id)
    attrs = docker_engine.containers.get(f"task-{task_id}").attrs
    labels = attrs["Config"]["Labels"]
    assert labels["heteroflow.model"] == "qwen"
    assert labels[MANAGED_LABEL] == "true" and labels[TASK_ID_LABEL] == str(task_id)  # ours win
    assert attrs["HostConfig"]["NetworkMode"] == "host"
    assert not attrs["HostConfig"].get("AutoRemove")
    assert runtime.state(task_id) is not None  # still there after it exited


def test_a_service_listens_on_the_host_port(runtime, run, tmp_path):
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "index.html").write_text("served-from-the-task\n")
    task_id = run(
        ["sh", "-c", 'exec httpd -f -p "$HETEROFLOW_PORT" -h /www'],
        env={"HETEROFLOW_PORT": str(port)},
        host_port=port,
        volumes=(Volume(host=str(tmp_path), container="/www", read_only=True),),
    )
    wait_running(runtime, task_id)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the host
    deadline = time.monotonic() + 10
    while True:
        try:
            with opener.open(f"http://127.0.0.1:{port}/index.html", timeout=2) as response:
                assert response.read() == b"served-from-the-task\n"
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    runtime.stop(task_id, grace_seconds=1)
    assert not runtime.state(task_id).running


def test_shm_size_and_ipc_host(runtime, run, docker_engine):
    shm = run(["sh", "-c", "df -k /dev/shm | tail -1"], shm_size_mb=96)
    ipc = run(["readlink", "/proc/self/ns/ipc"], ipc_host=True, shm_size_mb=96)  # the size cannot apply
    assert wait_exited(runtime, shm).exit_code == 0
    assert wait_exited(runtime, ipc).exit_code == 0
    assert docker_engine.containers.get(f"task-{shm}").attrs["HostConfig"]["ShmSize"] == 96 * 1024 * 1024
    assert str(96 * 1024) in runtime.logs_tail(shm)  # /dev/shm really is 96 MiB
    # the host's IPC namespace (Podman's inspect says "shareable" even so: look inside)
    assert runtime.logs_tail(ipc).strip() == os.readlink("/proc/self/ns/ipc")


def test_tasks_lists_every_managed_container_and_survives_a_new_runtime(
    runtime, run, docker_engine, docker_task_ids, docker_test_image, docker_test_labels
):
    done = run(["sh", "-c", "exit 5"])
    live = run(["sleep", "300"])
    wait_exited(runtime, done)
    wait_running(runtime, live)
    # not tasks: a task-N container without our labels, and our labels on another name
    stranger = docker_task_ids()
    docker_engine.containers.create(
        docker_test_image, ["true"], name=f"task-{stranger}", labels=docker_test_labels, network_mode="host"
    )
    impostor = docker_task_ids()
    docker_engine.containers.create(
        docker_test_image,
        ["true"],
        name=f"other-{impostor}",
        labels={**docker_test_labels, MANAGED_LABEL: "true", TASK_ID_LABEL: str(impostor)},
        network_mode="host",
    )
    try:
        for rt in (runtime, DockerRuntime()):  # a new instance: what a restarted agent sees
            held = rt.tasks()
            assert held[done].exit_code == 5 and not held[done].running
            assert held[live].running and held[live].exit_code is None
            assert stranger not in held and impostor not in held
            assert rt.state(stranger) is None  # not ours: as good as absent
        adopted = DockerRuntime()
        adopted.stop(live, grace_seconds=1)
        assert not adopted.state(live).running
    finally:
        docker_engine.containers.get(f"other-{impostor}").remove(force=True)


def test_state_of_an_unknown_task_is_none(runtime, docker_task_ids):
    task_id = docker_task_ids()
    assert runtime.state(task_id) is None
    assert runtime.logs_tail(task_id) == ""
    assert task_id not in runtime.tasks()


def test_name_conflict_with_a_running_leftover_raises_and_leaves_it(runtime, run, docker_task_ids):
    task_id = run(["sleep", "300"])
    wait_running(runtime, task_id)
    with pytest.raises(RuntimeError_, match="running"):
        run(["true"], task_id=task_id)
    assert runtime.state(task_id).running


def test_an_exited_leftover_of_the_same_task_is_replaced(runtime, run):
    task_id = run(["sh", "-c", "echo first; exit 7"])
    assert wait_exited(runtime, task_id).exit_code == 7
    run(["sh", "-c", "echo second"], task_id=task_id)
    assert wait_exited(runtime, task_id).exit_code == 0
    assert runtime.logs_tail(task_id) == "second\n"


def test_a_foreign_container_with_the_task_name_is_never_touched(
    runtime, run, docker_engine, docker_task_ids, docker_test_image, docker_test_labels
):
    task_id = docker_task_ids()
    docker_engine.containers.create(
        docker_test_image, ["true"], name=f"task-{task_id}", labels=docker_test_labels, network_mode="host"
    )
    with pytest.raises(RuntimeError_, match="did not start"):
        run(["true"], task_id=task_id)
    runtime.remove(task_id)
    runtime.stop(task_id)
    assert docker_engine.containers.get(f"task-{task_id}").status == "created"


def test_failed_start_leaves_nothing_behind(runtime, run, docker_task_ids):
    absent = docker_task_ids()
    with pytest.raises(RuntimeError_, match="not on this node"):
        run(["true"], task_id=absent, image="localhost/heteroflow-absent:1")
    assert runtime.state(absent) is None
    broken = docker_task_ids()
    with pytest.raises(RuntimeError_, match="cannot start"):
        run(["/no/such/program"], task_id=broken)
    assert runtime.state(broken) is None and broken not in runtime.tasks()


def test_remove_is_idempotent(runtime, run, docker_engine):
    task_id = run(["sleep", "300"])
    wait_running(runtime, task_id)
    runtime.remove(task_id)  # force: also a running one
    assert runtime.state(task_id) is None
    runtime.remove(task_id)
    assert not docker_engine.containers.list(all=True, filters={"name": f"task-{task_id}"})


def test_ensure_image_that_is_present_does_not_pull(runtime, docker_engine, docker_test_image, monkeypatch):
    pulls = []
    monkeypatch.setattr(runtime, "_pull_once", lambda *a: pulls.append(a))
    digests = docker_engine.images.get(docker_test_image).attrs.get("RepoDigests") or []
    for reference in [docker_test_image, *digests[:1]]:
        runtime.ensure_image(reference)
    assert pulls == []


def test_ensure_image_present_really_does_not_reach_a_registry(runtime, docker_test_image):
    # a pull of this reference fails here (no registry on localhost), so ensure_image would
    # raise after its attempts: returning means it pulled nothing
    runtime.ensure_image(docker_test_image)


def test_ensure_image_matches_tags_exactly(runtime, docker_test_image, monkeypatch):
    pulls = []

    def fake_pull(image, auth, secret):
        pulls.append(image)
        raise RuntimeError_("no registry here")

    monkeypatch.setattr(runtime, "_pull_once", fake_pull)
    other_tag = docker_test_image.rsplit(":", 1)[0] + ":not-this-one"
    with pytest.raises(RuntimeError_, match="after 2 attempt"):
        runtime.ensure_image(other_tag)
    assert pulls == [other_tag, other_tag]


def test_ensure_image_absent_fails_after_bounded_attempts(docker_engine, caplog):
    rt = DockerRuntime(pull_attempts=3, pull_attempt_timeout=5.0, pull_retry_delay=0.0)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="heteroflow_agent.runtime.docker"):
        with pytest.raises(RuntimeError_) as failure:
            rt.ensure_image("registry.invalid/heteroflow/absent:1")
    assert time.monotonic() - started < 15
    message = str(failure.value)
    assert message.startswith("cannot pull registry.invalid/heteroflow/absent:1 after 3 attempt(s): ")
    assert "registry.invalid" in message.split(": ", 1)[1]  # the engine's own words
    assert caplog.text.count("attempt 3 of 3") >= 1


def test_ensure_image_attempts_are_bounded_in_time(docker_engine):
    # connection refused: the engine retries internally for seconds, longer than the bound
    rt = DockerRuntime(pull_attempts=2, pull_attempt_timeout=0.5, pull_retry_delay=0.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError_, match=r"after 2 attempt\(s\): (timed out after 0.5 s|.*localhost:1)"):
        rt.ensure_image("localhost:1/heteroflow/absent:1")
    assert time.monotonic() - started < 4


def test_pull_credentials_never_appear_in_errors_or_logs(docker_engine, caplog):
    rt = DockerRuntime(pull_attempts=1, pull_attempt_timeout=5.0, pull_retry_delay=0.0)
    password = "s3cr3t-Pa55word-xyz"
    credentials = {"registry": "registry.invalid", "username": "robot", "password": password}
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(RuntimeError_) as failure:
            rt.ensure_image("registry.invalid/private/model:2", credentials)
    assert password not in str(failure.value) and password not in caplog.text
