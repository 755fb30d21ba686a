"""The model cache's ensure (heteroflow_agent.model_cache): a hub model downloaded from a
real HTTP mirror (Python's http.server on a socket, serving a generated file set with
its manifest), resumed after a cut connection, refused on a checksum mismatch; a path
source checked; the cache's budget evicting the least recently used model no replica
uses; progress throttled."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from agent.tests.model_cache_support import Mirror, Reports, gguf_model, hub

from heteroflow_agent.model_cache.ensure import ModelEnsurer, server_report
from heteroflow_agent.model_cache.fetch import Fetcher, parse_manifest
from heteroflow_agent.model_cache.progress import ProgressThrottle, QueuedReports
from heteroflow_agent.model_cache.store import EnsureCancelled, EnsureError, ModelStore, NoRoom, entry_key


@pytest.fixture
def mirror():
    served = Mirror()
    yield served
    served.close()


def ensurer(tmp_path, mirror, reports=None, budget=0, **kwargs) -> ModelEnsurer:
    return ModelEnsurer(
        ModelStore(tmp_path / "cache", budget),
        mirror=mirror.url,
        fetcher=Fetcher(timeout=(5.0, 10.0)),
        report=reports if reports is not None else Reports(),
        **kwargs,
    )


# --- hub --------------------------------------------------------------------------------


def test_a_hub_model_is_downloaded_checked_and_loaded_from_the_cache(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    reports = Reports()
    models = ensurer(tmp_path, mirror, reports)

    ensured = models.ensure(7, hub("org/tiny"))

    entry = tmp_path / "cache" / entry_key("hub", "org/tiny")
    assert ensured.source == str(entry / "tiny.gguf")  # llama.cpp takes the file
    assert (entry / "tiny.gguf").read_bytes() == files["tiny.gguf"]
    assert (entry / "README.md").read_bytes() == files["README.md"]
    assert not list(entry.rglob("*.part"))
    assert ensured.fetched and ensured.fetched_bytes == sum(len(d) for d in files.values())
    assert reports.states()[0] == "fetching" and reports.states()[-1] == "ready"
    # a second replica finds it there: nothing downloaded, nothing reported
    requests_before = len(mirror.requests)
    again = models.ensure(8, hub("org/tiny"))
    assert again.source == ensured.source and not again.fetched
    assert len(mirror.requests) == requests_before
    assert reports.states().count("ready") == 1


def test_a_cut_connection_is_resumed_with_a_range_request(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    mirror.cut["tiny.gguf"] = 100_000

    ensured = ensurer(tmp_path, mirror).ensure(1, hub("org/tiny"))

    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]
    first, resumed = mirror.file_requests("tiny.gguf")
    # from what reached the part file (a read the cut interrupted is asked again)
    assert first == "" and resumed.startswith("bytes=") and 0 < int(resumed[6:].rstrip("-")) <= 100_000


def test_a_part_left_by_an_earlier_agent_is_resumed_not_downloaded_again(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    entry = tmp_path / "cache" / entry_key("hub", "org/tiny")
    entry.mkdir(parents=True)
    (entry / "tiny.gguf.part").write_bytes(files["tiny.gguf"][:12_345])
    reports = Reports()

    ensured = ensurer(tmp_path, mirror, reports).ensure(1, hub("org/tiny"))

    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]
    assert mirror.file_requests("tiny.gguf") == ["bytes=12345-"]
    first = reports.sent[0][2]
    assert first["bytes_done"] >= 12_345 and first["bytes_total"] == sum(len(d) for d in files.values())


def test_a_fetch_cancelled_by_a_stopping_agent_is_not_a_failure_and_resumes_later(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model(1_000_000)
    reports = Reports()
    models = ensurer(tmp_path, mirror, reports, budget=10_000_000)
    arrived = []

    def stopping_after_some_bytes():
        arrived.append(1)
        return len(arrived) > 3

    with pytest.raises(EnsureCancelled):
        models.ensure(1, hub("org/tiny"), cancelled=stopping_after_some_bytes)

    assert "failed" not in reports.states() and "ready" not in reports.states()
    assert models.store.in_use() == set() and models.store.reserved == {}
    part = tmp_path / "cache" / entry_key("hub", "org/tiny") / "tiny.gguf.part"
    kept = part.stat().st_size
    assert 0 < kept < len(files["tiny.gguf"])
    ensured = models.ensure(2, hub("org/tiny"))
    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]
    assert mirror.file_requests("tiny.gguf")[-1] == f"bytes={kept}-"


def test_a_checksum_mismatch_deletes_the_part_and_fails_naming_the_file(tmp_path, mirror):
    mirror.files["org/tiny"] = gguf_model()
    mirror.lies["tiny.gguf"] = "0" * 64
    reports = Reports()
    models = ensurer(tmp_path, mirror, reports)

    with pytest.raises(EnsureError, match=r"tiny.gguf: checksum mismatch .*0{64}"):
        models.ensure(3, hub("org/tiny"))

    entry = tmp_path / "cache" / entry_key("hub", "org/tiny")
    assert not (entry / "tiny.gguf").exists() and not (entry / "tiny.gguf.part").exists()
    assert not models.store.complete(entry.name)
    assert reports.states()[-1] == "failed" and "checksum mismatch" in reports.sent[-1][2]["message"]
    assert models.store.in_use() == set()  # a failed ensure holds nothing


def test_without_checksums_the_sizes_alone_are_checked(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    mirror.without_checksums = True
    ensured = ensurer(tmp_path, mirror).ensure(1, hub("org/tiny"))
    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]


def test_a_model_the_mirror_does_not_have_fails_clearly(tmp_path, mirror):
    every_reason_names_the_model = r"^model org/absent: cannot read http://.*/org/absent/manifest.json: HTTP 404"
    with pytest.raises(EnsureError, match=every_reason_names_the_model):
        ensurer(tmp_path, mirror).ensure(1, hub("org/absent"))


def test_a_hub_model_without_a_mirror_says_how_to_set_one(tmp_path):
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), report=Reports())
    with pytest.raises(EnsureError, match="model_hub_url"):
        models.ensure(1, hub("org/tiny"))


def test_a_url_source_needs_no_mirror(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), report=Reports())
    ensured = models.ensure(1, {**hub("org/tiny"), "source": f"{mirror.url}/org/tiny"})
    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]


@pytest.mark.parametrize(
    "listing, problem",
    [
        ({"files": [{"path": "../escape", "size": 1}]}, "must be relative"),
        ({"files": [{"path": "/etc/passwd", "size": 1}]}, "must be relative"),
        ({"files": [{"path": "a.gguf", "size": -1}]}, "size"),
        ({"files": [{"path": "a.gguf", "size": 1, "sha256": "xyz"}]}, "64 hex"),
        ({"files": [{"path": "a", "size": 1}, {"path": "a", "size": 1}]}, "listed twice"),
        ({"files": []}, "expected"),
        ([], "expected"),
    ],
)
def test_a_bad_listing_is_refused_before_anything_is_written(listing, problem):
    with pytest.raises(EnsureError, match=problem):
        parse_manifest(listing, "http://mirror/org/x")


# --- a Hugging Face–compatible endpoint ---------------------------------------------------


def test_a_hugging_face_compatible_endpoint_lists_the_files_and_checks_the_large_ones(tmp_path, mirror):
    mirror.files["org/tiny"] = files = gguf_model()
    mirror.cut["tiny.gguf"] = 150_000
    models = ensurer(tmp_path, mirror, hub_api="huggingface")

    ensured = models.ensure(1, hub("org/tiny"))

    assert Path(ensured.source).read_bytes() == files["tiny.gguf"]
    assert (Path(ensured.source).parent / "README.md").read_bytes() == files["README.md"]
    assert mirror.requests[0][0] == "/api/models/org/tiny/revision/main?blobs=true"
    first, resumed = mirror.file_requests("tiny.gguf")
    assert first == "" and resumed.startswith("bytes=")
    assert all("/org/tiny/resolve/main/" in path for path, _ in mirror.requests[1:])


def test_a_hugging_face_checksum_mismatch_fails_and_an_unknown_repository_says_so(tmp_path, mirror):
    mirror.files["org/tiny"] = gguf_model()
    mirror.lies["tiny.gguf"] = "f" * 64
    models = ensurer(tmp_path, mirror, hub_api="huggingface")
    with pytest.raises(EnsureError, match="tiny.gguf: checksum mismatch"):
        models.ensure(1, hub("org/tiny"))
    with pytest.raises(EnsureError, match=r"api/models/org/absent/revision/main\?blobs=true: HTTP 404"):
        models.ensure(2, hub("org/absent"))


# --- path and the others ----------------------------------------------------------------


def test_a_path_model_must_exist_on_the_node(tmp_path):
    reports = Reports()
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), report=reports)
    there = tmp_path / "shared" / "tiny.gguf"
    there.parent.mkdir()
    there.write_bytes(b"GGUF")
    assert models.ensure(1, {"model": "tiny", "source_kind": "path", "source": str(there)}).source == str(there)

    missing = str(tmp_path / "shared" / "absent.gguf")
    with pytest.raises(EnsureError, match=rf"path {missing} does not exist on this node"):
        models.ensure(2, {"model": "tiny", "source_kind": "path", "source": missing})
    assert reports.states() == ["failed"]


def test_a_serving_without_a_source_kind_is_launched_as_it_is(tmp_path):
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), report=Reports())
    assert models.ensure(1, {"engine": "llama.cpp", "source": "/anywhere/x.gguf"}) is None


def test_an_image_model_on_a_node_without_a_container_engine_fails_saying_so(tmp_path):
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), report=Reports())
    with pytest.raises(EnsureError, match=r"^model m comes in an image .* no container engine to pull it"):
        models.ensure(1, {"model": "m", "source_kind": "image", "source": "registry.lan/models/m:1"})


# --- the budget -------------------------------------------------------------------------


def test_the_least_recently_used_model_no_replica_uses_is_evicted_first(tmp_path, mirror):
    for name in ("org/a", "org/b", "org/c", "org/d"):
        mirror.files[name] = {"w.gguf": os.urandom(100_000)}
    clock = iter(range(1000, 2000)).__next__
    models = ModelEnsurer(
        ModelStore(tmp_path / "cache", 350_000, clock=lambda: float(clock())),
        mirror=mirror.url,
        report=Reports(),
    )
    models.ensure(1, hub("org/a"))  # in use throughout
    models.ensure(2, hub("org/b"))
    models.release(2)
    models.ensure(3, hub("org/c"))
    models.release(3)  # c was used after b: b is the least recently used

    models.ensure(4, hub("org/d"))

    present = {e.key for e in models.store.entries()}
    assert entry_key("hub", "org/b") not in present
    assert {entry_key("hub", n) for n in ("org/a", "org/c", "org/d")} <= present


def test_a_model_in_use_is_never_evicted_and_a_model_that_cannot_fit_fails_clearly(tmp_path, mirror):
    mirror.files["org/a"] = {"w.gguf": os.urandom(200_000)}
    mirror.files["org/big"] = {"w.gguf": os.urandom(200_000)}
    reports = Reports()
    models = ensurer(tmp_path, mirror, reports, budget=300_000)
    models.ensure(1, hub("org/a"))

    held = entry_key("hub", "org/a")
    with pytest.raises(NoRoom, match=r"org/big needs 200000 bytes.*budget is 300000.*" + held):
        models.ensure(2, hub("org/big"))

    assert models.store.complete(entry_key("hub", "org/a"))
    assert not (tmp_path / "cache" / entry_key("hub", "org/big")).exists()  # nothing downloaded
    assert reports.states()[-1] == "failed"
    # once its replica ends, the unused model makes room
    models.release(1)
    models.ensure(2, hub("org/big"))
    assert not (tmp_path / "cache" / entry_key("hub", "org/a")).exists()


def test_a_download_in_progress_counts_at_its_full_size_until_it_ends(tmp_path):
    store = ModelStore(tmp_path / "cache", 300_000)
    assert store.make_room("a", 200_000, "org/a") == []  # reserved, nothing on disk yet
    with pytest.raises(NoRoom, match=r"org/b needs 200000 bytes.*200000 are held.*\(a\)"):
        store.make_room("b", 200_000, "org/b")
    store.settle("a")  # its fetch failed: the room is free again
    assert store.make_room("b", 200_000, "org/b") == []


def test_an_adopted_replica_holds_its_model(tmp_path, mirror):
    mirror.files["org/a"] = {"w.gguf": os.urandom(200_000)}
    mirror.files["org/b"] = {"w.gguf": os.urandom(200_000)}
    models = ensurer(tmp_path, mirror, budget=300_000)
    models.ensure(1, hub("org/a"))
    restarted = ensurer(tmp_path, mirror, budget=300_000)  # a new agent: nothing held in memory
    restarted.hold(1, hub("org/a"))
    with pytest.raises(NoRoom):
        restarted.ensure(2, hub("org/b"))


def test_two_replicas_of_one_model_download_it_once(tmp_path, mirror):
    mirror.files["org/tiny"] = gguf_model(2_000_000)
    models = ensurer(tmp_path, mirror)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(models.ensure(i, hub("org/tiny")))) for i in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(mirror.file_requests("tiny.gguf")) == 1
    assert sorted(r.fetched for r in results) == [False, True]
    assert models.store.in_use() == {entry_key("hub", "org/tiny")}


# --- progress ---------------------------------------------------------------------------


def test_progress_is_sent_at_most_once_per_interval_with_speed_and_eta():
    now = [0.0]
    sent = []
    throttle = ProgressThrottle(1000, sent.append, interval=2.0, clock=lambda: now[0])
    throttle.advance(100)  # the first: at once
    for _ in range(9):
        now[0] += 0.1
        throttle.advance(10)  # within the interval: held back
    assert len(sent) == 1 and sent[0].eta_seconds is None
    now[0] = 2.0
    throttle.advance(110)
    assert len(sent) == 2
    assert sent[1].bytes_done == 300 and sent[1].bytes_per_second == pytest.approx(100.0)
    assert sent[1].eta_seconds == pytest.approx(7.0)
    now[0] = 2.5
    throttle.advance(700)
    throttle.finish()  # the last figures, whatever the time
    assert sent[-1].bytes_done == 1000 and sent[-1].eta_seconds == 0.0


def test_a_download_reports_through_the_throttle(tmp_path, mirror):
    mirror.files["org/tiny"] = gguf_model(3_000_000)
    reports = Reports()
    ensurer(tmp_path, mirror, reports, progress_interval=3600).ensure(1, hub("org/tiny"))
    # the first report when it starts, the final figures, then ready: nothing in between
    assert reports.states() == ["fetching", "fetching", "ready"]
    assert reports.sent[1][2]["bytes_done"] == reports.sent[1][2]["bytes_total"]


def test_reports_go_to_the_control_plane_and_a_refusal_does_not_stop_the_download(server):
    from heteroflow_agent.client import ServerClient

    server.script["/api/v1/inference-replicas/5/model-ensure"] = [(503, {}, {}), (200, {}, {})]
    send = server_report(ServerClient(server.url, "k", attempts=1), "node-1")
    send(5, "fetching", {"bytes_done": 1, "bytes_total": 2})
    send(5, "ready", {"bytes_done": 2})
    assert send.flush(10)
    bodies = [r["json"] for r in server.requests]
    assert bodies == [
        {"node_id": "node-1", "state": "fetching", "bytes_done": 1, "bytes_total": 2},
        {"node_id": "node-1", "state": "ready", "bytes_done": 2},
    ]


def test_reports_never_hold_up_the_download_and_only_the_latest_figures_wait():
    sent, on_its_way, release = [], threading.Event(), threading.Event()

    def slow_control_plane(task_id, state, fields):
        on_its_way.set()
        release.wait(10)
        sent.append((task_id, state, fields["bytes_done"]))

    reports = QueuedReports(slow_control_plane)
    reports(1, "fetching", {"bytes_done": 1})
    assert on_its_way.wait(10)
    for done in range(2, 6):  # while the first is on its way, the others queue
        reports(1, "fetching", {"bytes_done": done})
    reports(2, "fetching", {"bytes_done": 7})
    reports(1, "ready", {"bytes_done": 10})
    assert not reports.flush(0.05)  # nothing above waited for the control plane
    release.set()
    assert reports.flush(10)
    # of those that queued, only the newest figures of each replica, and every end, in order
    assert sent == [(1, "fetching", 1), (1, "fetching", 5), (2, "fetching", 7), (1, "ready", 10)]
