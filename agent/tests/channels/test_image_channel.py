"""The image channel (channels/images.py) against a real registry and a real engine (see
conftest.py), with the scripted control plane of agent/tests/server.py. Every body the
agent sends, and every answer scripted here, is validated against the shared contract
(protocol/image_channel.schema.json, written by the server side)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jsonschema_rs
import pytest
from agent.tests.channels.support import StallingRegistry, remove_test_images, require_engine, require_registry
from agent.tests.waiting import wait_for

from heteroflow_agent.channels.images import PATH, ImageChannel, canonical, parse
from heteroflow_agent.client import ServerClient

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "heteroflow_agent" / "protocol" / "image_channel.schema.json").read_text()
)
NODE = "node-img-1"


# the real registry and engine (agent/tests/channels/support.py): skipped without them
# locally, failed without them in CI (HETEROFLOW_REQUIRE_REGISTRY=1)


@pytest.fixture(scope="session")
def image_registry() -> str:
    return require_registry()


@pytest.fixture(scope="session")
def image_engine(image_registry):
    client = require_engine()
    yield client
    client.close()


@pytest.fixture
def clean_engine(image_engine, image_registry):
    """The engine without any of the registry's test images, before and after the test."""
    remove_test_images(image_engine, image_registry)
    yield image_engine
    remove_test_images(image_engine, image_registry)


def validator(definition: str | None = None):
    schema = dict(SCHEMA)
    if definition:
        schema = {**SCHEMA, "$ref": f"#/definitions/{definition}"}
        schema.pop("oneOf")
    return jsonschema_rs.validator_for(schema)


REPORT = validator()  # the PUT body: claim, progress or final
REQUEST = validator("request")
LISTING = validator("agent_list")
CHECK_ITEM = validator("check_item")


def row(request_id: int, action: str, references: list[str], status: str = "pending") -> dict:
    """A request row as the server answers it (checked against the contract)."""
    body = {
        "id": request_id,
        "node_id": NODE,
        "action": action,
        "references": references,
        "status": status,
        "progress": {},
        "progress_at": None,
        "result": {},
        "error": "",
        "requested_by": "ops",
        "created_at": "2026-12-01T19:00:00Z",
        "claimed_at": None,
        "deadline": "2026-12-01T21:00:00Z",
        "finished_at": None,
    }
    REQUEST.validate(body)
    return body


def listing(*rows: dict) -> tuple[int, dict]:
    body = {"results": list(rows)}
    LISTING.validate(body)
    return 200, body


@pytest.fixture
def plane(server):
    """The scripted control plane: every PUT not scripted is taken (200 with a row)."""
    server.default = (200, row(1, "pull", ["x/y:1"], "processing"), {})
    return server


def puts(server, request_id: int | None = None) -> list[dict]:
    bodies = [
        r["json"]
        for r in server.requests
        if r["method"] == "PUT" and (request_id is None or r["path"] == f"{PATH}/{request_id}")
    ]
    for body in bodies:
        REPORT.validate(body)  # the contract: what the server's tests hold the agent to
    return bodies


def progress_of(bodies: list[dict]) -> list[dict]:
    return [b["progress"] for b in bodies if b["status"] == "processing" and b["from_status"] == "processing"]


def final_of(bodies: list[dict]) -> dict:
    finals = [b for b in bodies if b["status"] in ("completed", "failed")]
    assert len(finals) == 1, bodies
    return finals[0]


@pytest.fixture
def channel(plane):
    made = []

    def make(**options) -> ImageChannel:
        client = ServerClient(plane.url, "agent-key", attempts=1)
        made.append(ImageChannel(NODE, client, **{"engine_timeout": 60.0, **options}))
        return made[-1]

    yield make
    for one in made:
        one.close()
        one.client.close()


@pytest.fixture
def stalling():
    registry = StallingRegistry()
    yield registry
    registry.release()


# ---- no engine needed ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("127.0.0.1:5055/repo/x:1.0", ("127.0.0.1:5055/repo/x", "1.0", None)),
        ("127.0.0.1:5055/repo/x", ("127.0.0.1:5055/repo/x", None, None)),
        ("repo/x@sha256:" + "a" * 64, ("repo/x", None, "sha256:" + "a" * 64)),
        ("repo/x:1@sha256:" + "b" * 64, ("repo/x", "1", "sha256:" + "b" * 64)),
    ],
)
def test_parse_keeps_what_was_written(reference, expected):
    assert parse(reference) == expected


def test_canonical_names_as_the_engine_lists_them():
    assert canonical("busybox") == "docker.io/library/busybox"
    assert canonical("index.docker.io/lmsys/sglang") == "docker.io/lmsys/sglang"
    assert canonical("127.0.0.1:5055/heteroflow/probe") == "127.0.0.1:5055/heteroflow/probe"
    assert canonical("localhost/x") == "localhost/x"


def test_credentials_are_the_nodes_docker_config(tmp_path, channel):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {"registry.example:5000": {"auth": "dXNlcjpzZWNyZXQ="}}}))
    one = channel(auth_file=str(config))
    auth = one._auth("registry.example:5000/team/engine")
    assert auth["username"] == "user" and auth["password"] == "secret"
    assert one._auth("other.example/team/engine") is None
    assert channel()._auth("registry.example:5000/team/engine") is None  # no file: the docker client's own


def test_a_lost_claim_moves_on_to_the_next_request(plane, channel):
    plane.answer(PATH, listing(row(7, "check", ["a/b:1"]), row(8, "check", ["a/b:2"])))
    plane.answer(f"{PATH}/7", (409, {"error": {"code": "conflict", "message": "not pending"}}))
    one = channel()
    assert one.poll() == 8
    claims = puts(plane)
    assert claims == [
        {"node_id": NODE, "from_status": "pending", "status": "processing"},
        {"node_id": NODE, "from_status": "pending", "status": "processing"},
    ]
    assert [r["path"] for r in plane.requests if r["method"] == "PUT"] == [f"{PATH}/7", f"{PATH}/8"]
    get = next(r for r in plane.requests if r["method"] == "GET")
    assert get["path"] == f"{PATH}?node_id={NODE}&status=pending"
    assert get["headers"]["X-API-Key"] == "agent-key"
    # the worker holds 8: the next round claims nothing, not even a new request
    plane.answer(PATH, listing(row(9, "check", ["a/b:3"])))
    assert one.poll() is None
    assert len(puts(plane)) == 2


def test_a_refused_start_report_ends_the_request_without_pulling(plane, channel, clean_engine, image_registry):
    plane.answer(f"{PATH}/3", (409, {"error": {"code": "conflict", "message": "failed by the janitor"}}))
    assert channel().handle(row(3, "pull", [f"{image_registry}/heteroflow/probe:1.0"], "processing")) is None
    assert len(puts(plane, 3)) == 1  # the start report, refused; no final
    assert not [i for i in clean_engine.images.list() if f"{image_registry}/heteroflow/probe:1.0" in i.tags]


# ---- the real registry and engine ------------------------------------------------------------


def test_pull_reports_progress_then_completes_with_the_check(plane, channel, clean_engine, image_registry):
    reference = f"{image_registry}/heteroflow/probe:2.0"
    final = channel(progress_seconds=0).handle(row(11, "pull", [reference], "processing"))
    bodies = puts(plane, 11)
    assert final == {k: v for k, v in bodies[-1].items() if k != "node_id"}
    progress = progress_of(bodies)
    assert progress[0]["message"] == f"pulling {reference}" and progress[0]["layers_done"] == 0
    assert len(progress) >= 3, progress  # the engine's events, each one that moved reported (interval 0)
    done = [p["layers_done"] for p in progress]
    assert done == sorted(done) and done[-1] >= 2  # busybox's layer and the payload's
    image = clean_engine.images.get(reference)
    assert final_of(bodies) == {
        "node_id": NODE,
        "from_status": "processing",
        "status": "completed",
        "result": {
            "images": [
                {
                    "reference": reference,
                    "present": True,
                    "match": "exact",
                    "image_id": image.id,
                    "size_bytes": image.attrs["Size"],
                    "tags": [],
                }
            ]
        },
    }
    assert image.attrs["Size"] > 4 * 1024 * 1024  # the 4 MiB payload layer is in it


def test_the_default_interval_reports_once_at_the_start_of_a_quick_pull(plane, channel, clean_engine, image_registry):
    reference = f"{image_registry}/heteroflow/probe:1.0"
    channel().handle(row(12, "pull", [reference], "processing"))  # 60 s between reports
    bodies = puts(plane, 12)
    assert len(progress_of(bodies)) == 1
    assert final_of(bodies)["status"] == "completed"


def test_a_digest_pull_checks_the_digest(plane, channel, clean_engine, image_registry):
    clean_engine.images.pull(f"{image_registry}/heteroflow/other", tag="1.0")
    digest = clean_engine.images.get(f"{image_registry}/heteroflow/other:1.0").attrs["RepoDigests"][0].split("@")[1]
    clean_engine.images.remove(f"{image_registry}/heteroflow/other:1.0", force=True)
    reference = f"{image_registry}/heteroflow/other@{digest}"
    final = channel().handle(row(13, "pull", [reference], "processing"))
    item = final["result"]["images"][0]
    assert final["status"] == "completed" and item["present"] and item["match"] == "exact", final
    assert item["reference"] == reference


def test_a_missing_tag_fails_with_the_engines_error(plane, channel, clean_engine, image_registry):
    reference = f"{image_registry}/heteroflow/probe:9.9"
    channel().handle(row(14, "pull", [reference], "processing"))
    final = final_of(puts(plane, 14))
    assert final["status"] == "failed"
    assert final["error"].startswith(f"pull of {reference} failed: ")
    assert "manifest unknown" in final["error"]


def test_check_exact_and_repository_matches(plane, channel, clean_engine, image_registry):
    probe, other = f"{image_registry}/heteroflow/probe", f"{image_registry}/heteroflow/other"
    for repo, tag in ((probe, "1.0"), (probe, "2.0"), (probe, "latest"), (other, "1.0")):
        clean_engine.images.pull(repo, tag=tag)
    one, two = clean_engine.images.get(f"{probe}:1.0"), clean_engine.images.get(f"{probe}:2.0")
    digest = one.attrs["RepoDigests"][0].split("@")[1]
    asked = [
        f"{probe}:1.0",
        f"{probe}@{digest}",
        probe,
        other,
        f"{probe}:9.9",
        f"{image_registry}/heteroflow/absent",
        "heteroflow/probe:1.0",  # Docker Hub's heteroflow/probe: a different image, not a loose match
    ]
    final = channel().handle(row(15, "check", asked, "processing"))
    assert final["status"] == "completed"
    items = {item["reference"]: item for item in final["result"]["images"]}
    assert list(items) == asked
    for item in items.values():
        CHECK_ITEM.validate(item)
    assert items[f"{probe}:1.0"] == {
        "reference": f"{probe}:1.0",
        "present": True,
        "match": "exact",
        "image_id": one.id,
        "size_bytes": one.attrs["Size"],
        "tags": [],
    }
    assert items[f"{probe}@{digest}"]["present"] and items[f"{probe}@{digest}"]["image_id"] == one.id
    repository = items[probe]
    assert repository["match"] == "repository" and repository["present"]
    assert repository["tags"] == [
        {"tag": f"{probe}:1.0", "image_id": one.id, "size_bytes": one.attrs["Size"]},
        {"tag": f"{probe}:2.0", "image_id": two.id, "size_bytes": two.attrs["Size"]},
        {"tag": f"{probe}:latest", "image_id": one.id, "size_bytes": one.attrs["Size"]},
    ]
    assert repository["image_id"] is None and repository["size_bytes"] is None  # two images
    assert items[other]["tags"] == [
        {"tag": f"{other}:1.0", "image_id": items[other]["image_id"], "size_bytes": items[other]["size_bytes"]}
    ]
    assert items[other]["image_id"] == one.id  # other:1.0 is the same busybox image: one image
    for absent in (f"{probe}:9.9", "heteroflow/probe:1.0"):
        assert items[absent] == {
            "reference": absent,
            "present": False,
            "match": "exact",
            "image_id": None,
            "size_bytes": None,
            "tags": [],
        }
    assert items[f"{image_registry}/heteroflow/absent"]["present"] is False
    assert items[f"{image_registry}/heteroflow/absent"]["match"] == "repository"


def test_the_old_agents_latest_answer(plane, channel, clean_engine, image_registry):
    probe = f"{image_registry}/heteroflow/probe"
    old = channel(legacy_latest=True)
    pulled = old.handle(row(16, "pull", [probe], "processing"))
    latest = clean_engine.images.get(f"{probe}:latest")
    assert pulled["status"] == "completed"
    assert pulled["result"]["images"] == [
        {
            "reference": f"{probe}:latest",
            "present": True,
            "match": "exact",
            "image_id": latest.id,
            "size_bytes": latest.attrs["Size"],
            "tags": [],
        }
    ]
    checked = old.handle(row(17, "check", [probe], "processing"))
    assert checked["result"]["images"] == pulled["result"]["images"]
    # a current agent answers the same bare repository with every local tag
    current = channel().handle(row(18, "check", [probe], "processing"))["result"]["images"][0]
    assert current["reference"] == probe and current["match"] == "repository"
    assert [t["tag"] for t in current["tags"]] == [f"{probe}:latest"]
    puts(plane)  # all of them valid reports


def test_a_stalled_pull_reports_no_progress(plane, channel, image_engine, stalling):
    reference = f"{stalling.address}/heteroflow/probe:1.0"
    one = channel(progress_seconds=0)  # would report every event at once
    worker = threading.Thread(target=one.handle, args=(row(19, "pull", [reference], "processing"),), daemon=True)
    worker.start()
    # the engine is connected and has sent its request; no answer ever comes
    wait_for(lambda: stalling.received > 0, 30, "the engine's request to the stalling registry")
    assert worker.is_alive()
    assert progress_of(puts(plane, 19)) == [
        {
            "layers_done": 0,
            "layers_total": 0,
            "bytes_done": None,
            "bytes_total": None,
            "message": f"pulling {reference}",
        }
    ]
    stalling.release()  # the registry goes away: the pull fails, still without progress
    worker.join(timeout=120)
    bodies = puts(plane, 19)
    assert len(progress_of(bodies)) == 1
    final = final_of(bodies)
    assert final["status"] == "failed" and final["error"].startswith(f"pull of {reference} failed: "), final


def test_a_stalled_image_pull_never_blocks_a_tasks_pull(plane, channel, clean_engine, image_registry, stalling):
    from heteroflow_agent.runtime.docker import DockerRuntime

    one = channel()
    reference = f"{stalling.address}/heteroflow/probe:1.0"
    worker = threading.Thread(target=one.handle, args=(row(20, "pull", [reference], "processing"),), daemon=True)
    worker.start()
    wait_for(lambda: stalling.received > 0, 30, "the image channel's stalled pull")
    task_image = f"{image_registry}/heteroflow/probe:2.0"
    started = time.monotonic()
    DockerRuntime(pull_attempts=1, pull_attempt_timeout=60.0).ensure_image(task_image)
    assert clean_engine.images.get(task_image)
    assert worker.is_alive(), "the channel's pull was still stalled while the task's pull ran"
    assert time.monotonic() - started < 60
    stalling.release()
    worker.join(timeout=120)


def test_the_poller_runs_requests_one_at_a_time(plane, channel, clean_engine, image_registry, stalling):
    stalled = row(21, "pull", [f"{stalling.address}/heteroflow/probe:1.0"])
    check = row(22, "check", [f"{image_registry}/heteroflow/probe:1.0"])
    plane.answer(PATH, listing(stalled, check), listing(check))  # then no more pending
    one = channel(poll_seconds=0.05)
    stop = threading.Event()
    poller = threading.Thread(target=one.run, args=(stop,), daemon=True)
    poller.start()
    try:
        wait_for(lambda: stalling.received > 0, 30, "the first request's pull")
        # the worker is busy: another round claims nothing
        assert one.poll() is None
        assert [r["path"] for r in plane.requests if r["method"] == "PUT"] == [f"{PATH}/21", f"{PATH}/21"]
        stalling.release()
        wait_for(lambda: len(puts(plane, 22)) == 2, 90, "the second request claimed and answered")
    finally:
        stop.set()
        poller.join(timeout=10)
    first, second = puts(plane, 21), puts(plane, 22)
    assert final_of(first)["status"] == "failed"
    assert second[0]["from_status"] == "pending" and final_of(second)["status"] == "completed"
    paths = [r["path"] for r in plane.requests if r["method"] == "PUT"]
    assert paths.index(f"{PATH}/22") > max(i for i, p in enumerate(paths) if p == f"{PATH}/21")


# ---- the agent's wiring ------------------------------------------------------------------


def test_the_channel_runs_only_beside_the_docker_runtime(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from heteroflow_agent import config as agent_config
    from heteroflow_agent.main import TEST_REMOVE_AFTER_PULL, build_image_channel

    monkeypatch.delenv(TEST_REMOVE_AFTER_PULL, raising=False)
    cfg = agent_config.load(
        "-",
        environ={
            "HETEROFLOW_SERVER_URL": "http://127.0.0.1:9",
            "HETEROFLOW_AGENT_KEY": "k",
            "HETEROFLOW_NODE_ID": NODE,
            "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
            "HETEROFLOW_IMAGE_PROGRESS_SECONDS": "2.5",
            "HETEROFLOW_IMAGE_LEGACY_LATEST": "true",
            "HETEROFLOW_IMAGE_AUTH_FILE": "/etc/docker-config/config.json",
        },
    )
    assert build_image_channel(cfg, None) is None
    assert build_image_channel(cfg, SimpleNamespace(kind="process")) is None
    channel = build_image_channel(cfg, SimpleNamespace(kind="docker"))
    assert (channel.node_id, channel.progress_seconds, channel.legacy_latest) == (NODE, 2.5, True)
    assert channel.auth_file == "/etc/docker-config/config.json" and channel.after_pull is None
    assert channel.poll_seconds == 5.0
    assert agent_config.load("-", environ={**_base(tmp_path)}).image_progress_seconds == 60.0
    with pytest.raises(agent_config.ConfigError, match="image_auth_file"):
        agent_config.load("-", environ={**_base(tmp_path), "HETEROFLOW_IMAGE_AUTH_FILE": "relative.json"})


def _base(tmp_path) -> dict:
    return {
        "HETEROFLOW_SERVER_URL": "http://127.0.0.1:9",
        "HETEROFLOW_AGENT_KEY": "k",
        "HETEROFLOW_NODE_ID": NODE,
        "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
    }


# ---- progress: Docker Engine's event stream, and the 60 s rule ------------------------------------

# A pull's events as Docker Engine's API streams them (POST /images/create, one JSON object
# a line; the documented shape: status, id, progressDetail {current, total}, progress text).
DOCKER_EVENTS = [
    {"status": "Pulling from library/busybox", "id": "1.36"},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": "a3ed95caeb02"},
    {"status": "Pulling fs layer", "progressDetail": {}, "id": "9ad63333ebc9"},
    {"status": "Waiting", "progressDetail": {}, "id": "9ad63333ebc9"},
    {"status": "Downloading", "progressDetail": {"current": 32768, "total": 2155034}, "id": "a3ed95caeb02"},
    {"status": "Downloading", "progressDetail": {"current": 1048576, "total": 2155034}, "id": "a3ed95caeb02"},
    {"status": "Verifying Checksum", "progressDetail": {}, "id": "a3ed95caeb02"},
    {"status": "Download complete", "progressDetail": {}, "id": "a3ed95caeb02"},
    {"status": "Extracting", "progressDetail": {"current": 131072, "total": 4861952}, "id": "a3ed95caeb02"},
    {"status": "Downloading", "progressDetail": {"current": 5000, "total": 10000}, "id": "9ad63333ebc9"},
    {"status": "Pull complete", "progressDetail": {}, "id": "a3ed95caeb02"},
    {"status": "Download complete", "progressDetail": {}, "id": "9ad63333ebc9"},
    {"status": "Pull complete", "progressDetail": {}, "id": "9ad63333ebc9"},
    {"status": "Digest: sha256:" + "c" * 64},
    {"status": "Status: Downloaded newer image for busybox:1.36"},
]


class FakeEngine:
    """A docker client whose pull streams DOCKER_EVENTS, moving a clock by `gaps` seconds
    before each event; the image is then there."""

    def __init__(self, clock, gaps):
        self.clock, self.gaps = clock, gaps
        self.api = self
        self.images = self

    def pull(self, repository, tag=None, **options):
        assert (repository, tag, options["stream"], options["decode"]) == ("busybox", "1.36", True, True)
        for gap, event in zip(self.gaps, DOCKER_EVENTS, strict=True):
            self.clock.now += gap
            yield event

    def get(self, reference):
        from types import SimpleNamespace

        return SimpleNamespace(id="sha256:" + "d" * 64, attrs={"Size": 4861952, "RepoTags": ["busybox:1.36"]})

    def close(self):
        pass


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def test_progress_from_dockers_events_at_most_every_60_seconds(plane, channel):
    clock = Clock()
    # the first downloads come quickly; a 70 s silence; then the rest
    gaps = [1, 1, 1, 1, 1, 1, 1, 70, 1, 1, 1, 1, 80, 1, 1]
    one = channel(clock=clock)
    one._docker = FakeEngine(clock, gaps)
    final = one.handle(row(30, "pull", ["busybox:1.36"], "processing"))
    progress = progress_of(puts(plane, 30))
    assert progress == [
        {
            "layers_done": 0,
            "layers_total": 0,
            "bytes_done": None,
            "bytes_total": None,
            "message": "pulling busybox:1.36",
        },
        # 71 s after the start: a3ed95caeb02 downloaded (its bytes in full), 9ad63333ebc9 waiting
        {
            "layers_done": 1,
            "layers_total": 2,
            "bytes_done": 2155034,
            "bytes_total": 2155034,
            "message": "a3ed95caeb02: Download complete",
        },
        # 84 s later, both layers pulled; extraction's bytes never counted
        {
            "layers_done": 2,
            "layers_total": 2,
            "bytes_done": 2165034,
            "bytes_total": 2165034,
            "message": "9ad63333ebc9: Pull complete",
        },
    ]
    assert final["status"] == "completed"
    assert final["result"]["images"][0]["present"] and final["result"]["images"][0]["match"] == "exact"


def test_a_progress_report_refused_mid_pull_ends_it_without_a_final_report(plane, channel):
    clock = Clock()
    one = channel(clock=clock, progress_seconds=0)
    one._docker = FakeEngine(clock, [1] * len(DOCKER_EVENTS))
    plane.answer(f"{PATH}/31", (200, row(31, "pull", ["busybox:1.36"], "processing")))  # the start report
    plane.answer(f"{PATH}/31", (409, {"error": {"code": "conflict", "message": "failed by the janitor"}}))
    assert one.handle(row(31, "pull", ["busybox:1.36"], "processing")) is None
    bodies = puts(plane, 31)
    assert len(bodies) == 2 and all(b["status"] == "processing" for b in bodies)


def test_an_unknown_action_fails_saying_so(plane, channel):
    final = channel().execute({**row(32, "check", ["a/b:1"], "processing"), "action": "prune"})
    assert final == {
        "from_status": "processing",
        "status": "failed",
        "error": "this agent does not know the action 'prune'",
    }
