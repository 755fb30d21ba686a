"""The slice command channel against the scripted control plane, with the real vendors
driving stateful stand-in tools: claim, re-validation, execution, truthful reports."""

from __future__ import annotations

import threading
import time

import pytest

from heteroflow_agent.channels.slices import PATH, SliceChannel, default_vendors
from heteroflow_agent.client import ServerClient
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.main import build_slice_channel
from heteroflow_agent.slicing.base import Budget, Outcome, Vendor

GPU0 = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a70"


def request(rid=1, action="create", vendor="nvidia-mig", **params):
    base = {
        "gpu_index": 0,
        "gpu_uuid": GPU0,
        "profile": "1g.5gb",
        "memory_mb": 4864,
        "compute_percent": 14,
        "device_id": "",
        "handles": {},
    }
    base.update(params)
    return {
        "id": rid,
        "node_id": "n1",
        "slice_id": 100 + rid,
        "action": action,
        "vendor": vendor,
        "params": base,
        "status": "pending",
        "created_at": "2026-12-01T19:00:00Z",
    }


def offer(server, *requests):
    server.answer(PATH, (200, {"results": list(requests)}))


def accept(server, rid, *answers):
    """The claim is taken (200), then the given answers for the report(s)."""
    server.answer(f"{PATH}/{rid}", (200, {"id": rid, "status": "processing"}), *(answers or [(200, {"id": rid})]))


def puts(server, rid):
    return [r["json"] for r in server.requests if r["method"] == "PUT" and r["path"] == f"{PATH}/{rid}"]


@pytest.fixture
def channel(server, client, cards):
    reports = ServerClient(server.url, "k", attempts=2, sleep=lambda s: None)
    made = SliceChannel(
        "n1", client, report_client=reports, vendors=default_vendors(str(cards.root)), tool_timeout=10.0
    )
    yield made
    made.close()
    reports.close()


def drain(channel) -> list:
    """What the worker thread does, in this thread: every queued request to its end."""
    done = []
    while not channel.queue.empty():
        item = channel.queue.get_nowait()
        done.append(channel.handle(item))
        channel.waiting.discard(item["id"])
    return done


def run_one(server, channel, req) -> dict:
    offer(server, req)
    accept(server, req["id"])
    assert channel.poll() == [req["id"]]
    assert drain(channel) == [True]
    claim, report = puts(server, req["id"])
    assert claim == {"node_id": "n1", "from_status": "pending", "status": "processing"}
    assert report["from_status"] == "processing" and report["node_id"] == "n1"
    return report


# --- nvidia-mig --------------------------------------------------------------------------


def test_a_mig_create_makes_the_instance_and_reports_its_uuid_and_handles(server, channel, cards):
    cards.nvidia()
    report = run_one(server, channel, request(profile="3g.20gb"))
    assert report["status"] == "completed", report
    (instance,) = cards.instances()
    uuid = instance["cis"][0]["uuid"]
    assert report["result"] == {
        "created": [{"uuid": uuid, "gi": instance["id"], "ci": 0, "profile": "3g.20gb"}],
        "destroyed": [],
        "device_id": uuid,
        "handles": {"gi": instance["id"], "ci": 0},
    }
    assert report["error"] == ""
    # the profile was looked up for this card and created by its id, on this card
    assert ["mig", "-lgip", "-i", "0"] in cards.calls("mig")
    assert ["mig", "-cgi", "9", "-C", "-i", "0"] in cards.calls("mig")
    fetch = next(r for r in server.requests if r["method"] == "GET")
    assert "node_id=n1" in fetch["path"] and "status=pending" in fetch["path"]


def test_instances_survive_between_calls_and_a_destroy_removes_ci_then_gi(server, channel, cards):
    cards.nvidia()
    first = run_one(server, channel, request(1, profile="2g.10gb"))
    second = run_one(server, channel, request(2, profile="2g.10gb"))
    assert {first["result"]["handles"]["gi"], second["result"]["handles"]["gi"]} == {1, 2}
    assert len(cards.instances()) == 2
    target = first["result"]
    report = run_one(
        server, channel, request(3, action="destroy", device_id=target["device_id"], handles=target["handles"])
    )
    assert report["status"] == "completed", report
    assert report["result"]["destroyed"] == [{"uuid": target["device_id"], "gi": 1, "ci": 0}]
    assert [gi["id"] for gi in cards.instances()] == [2]  # the other one is untouched
    destroys = [c for c in cards.calls("mig") if "-dci" in c or "-dgi" in c]
    assert destroys == [["mig", "-dci", "-ci", "0", "-gi", "1", "-i", "0"], ["mig", "-dgi", "-gi", "1", "-i", "0"]]


def test_gi_made_ci_failed_is_reported_with_what_exists_then_destroyed(server, channel, cards):
    cards.nvidia()
    cards.fail(cci="Insufficient Resources")
    report = run_one(server, channel, request(profile="1g.5gb"))
    assert report["status"] == "failed"
    assert report["result"]["created"] == [{"uuid": "", "gi": 1, "profile": "1g.5gb"}]  # the GPU instance, no CI
    assert "Unable to create a compute instance" in report["error"] and "Insufficient Resources" in report["error"]
    assert "exit code 255" in report["error"]
    assert [(gi["id"], gi["cis"]) for gi in cards.instances()] == [(1, [])]
    # the server's destroy of the orphan names the GPU instance alone: no -dci, one -dgi
    report = run_one(server, channel, request(2, action="destroy", handles={"gi": 1}))
    assert report["status"] == "completed", report
    assert report["result"]["destroyed"] == [{"uuid": "", "gi": 1}]
    assert cards.instances() == []
    assert not [c for c in cards.calls("mig") if "-dci" in c]


def test_a_create_reports_only_what_it_made(server, channel, cards):
    """An instance someone else made meanwhile is not this request's: a failed create
    reports only its own GPU instance, which the server then destroys."""
    cards.nvidia()
    cards.update(
        meanwhile=[{"id": 1, "profile": "2g.10gb", "start": 0, "size": 2, "cis": [{"id": 0, "uuid": "MIG-op"}]}]
    )
    cards.fail(cci="Insufficient Resources")
    report = run_one(server, channel, request(profile="1g.5gb"))
    assert report["status"] == "failed"
    assert report["result"]["created"] == [{"uuid": "", "gi": 2, "profile": "1g.5gb"}]


def test_a_full_card_fails_the_way_nvidia_smi_does(server, channel, cards):
    cards.nvidia()
    assert run_one(server, channel, request(1, profile="7g.40gb"))["status"] == "completed"
    report = run_one(server, channel, request(2, profile="1g.5gb"))
    assert report["status"] == "failed"
    assert report["error"] == (
        "Unable to create a GPU instance on GPU  0 using profile 1g.5gb: Insufficient Resources (exit code 255)"
    )
    assert report["result"]["created"] == []
    assert len(cards.instances()) == 1


@pytest.mark.parametrize(
    "params, why",
    [
        ({"profile": "9g.99gb"}, "is not a MIG profile of GPU 0"),
        ({"gpu_index": 3}, "this node has no GPU 3"),
        ({"gpu_uuid": "GPU-someone-else"}, f"GPU 0 is {GPU0}, not GPU-someone-else"),
        ({"gpu_index": "0"}, "is not a card index"),
    ],
)
def test_a_create_is_revalidated_before_anything_is_made(server, channel, cards, params, why):
    cards.nvidia()
    report = run_one(server, channel, request(**params))
    assert report["status"] == "failed"
    assert report["error"].startswith("refused: ") and why in report["error"]
    assert report["result"] == {"created": [], "destroyed": []}
    assert not [c for c in cards.calls("mig") if "-cgi" in c]
    assert cards.instances() == []


def test_a_create_is_refused_on_a_card_not_in_mig_mode(server, channel, cards):
    cards.nvidia(mig=False)
    report = run_one(server, channel, request())
    assert report["status"] == "failed" and "lists no MIG profiles" in report["error"]
    assert "No MIG-enabled devices found" in report["error"]


def test_a_create_whose_instance_is_already_there_is_not_made_again(server, channel, cards):
    cards.nvidia()
    made = run_one(server, channel, request(1))["result"]
    report = run_one(server, channel, request(2, device_id=made["device_id"], handles=made["handles"]))
    assert report["status"] == "failed" and "already has the instance gi 1" in report["error"]
    assert len(cards.instances()) == 1


def test_a_destroy_never_touches_an_instance_that_is_now_someone_elses(server, channel, cards):
    cards.nvidia()
    made = run_one(server, channel, request(1))["result"]
    report = run_one(
        server, channel, request(2, action="destroy", device_id="MIG-gone-long-ago", handles={"gi": 1, "ci": 0})
    )
    assert report["status"] == "failed"
    assert f"is now {made['device_id']}, not MIG-gone-long-ago" in report["error"]
    assert len(cards.instances()) == 1
    assert not [c for c in cards.calls("mig") if "-dci" in c or "-dgi" in c]


def test_a_destroy_of_what_is_already_gone_completes_with_nothing_destroyed(server, channel, cards):
    cards.nvidia()
    report = run_one(server, channel, request(action="destroy", device_id="MIG-x", handles={"gi": 4, "ci": 0}))
    assert report["status"] == "completed"
    assert report["result"] == {"created": [], "destroyed": []}


def test_a_destroy_that_the_tool_refuses_keeps_what_is_left_in_the_report(server, channel, cards):
    cards.nvidia()
    made = run_one(server, channel, request(1))["result"]
    cards.fail(dgi="In use by another client")
    report = run_one(
        server, channel, request(2, action="destroy", device_id=made["device_id"], handles=made["handles"])
    )
    assert report["status"] == "failed" and "In use by another client" in report["error"]
    assert report["result"]["destroyed"] == [{"uuid": made["device_id"], "gi": 1, "ci": 0}]  # the CI went
    assert report["result"]["handles"] == {"gi": 1}  # the GPU instance stays


def test_a_request_that_runs_past_its_limit_is_reported_failed(server, client, cards):
    cards.nvidia()
    cards.update(sleep={"cgi": 5})
    channel = SliceChannel("n1", client, vendors=default_vendors(str(cards.root)), request_seconds=2.0)
    channel.report_client = client
    began = time.monotonic()
    report = run_one(server, channel, request())
    assert time.monotonic() - began < 4.5  # the stuck tool was killed at the limit
    assert report["status"] == "failed"
    assert "timed out" in report["error"] or "limit of the request ran out" in report["error"]


# --- nvidia-mps and hygon-hami through the channel ---------------------------------------


def test_mps_create_needs_the_daemon_alive(server, channel, cards):
    cards.nvidia(mig=False)
    cards.mps(alive=False)
    report = run_one(server, channel, request(1, vendor="nvidia-mps", memory_mb=8192, compute_percent=20))
    assert report["status"] == "failed"
    assert report["error"] == "the MPS control daemon does not answer (Cannot find MPS control daemon process)"
    cards.mps(alive=True, servers=[4242])
    report = run_one(server, channel, request(2, vendor="nvidia-mps", memory_mb=8192, compute_percent=20))
    assert report["status"] == "completed", report
    assert report["result"]["device_id"] == GPU0
    assert report["result"]["handles"]["pinned_device_mem_limit"] == "0=8192M"
    assert ["nvidia-cuda-mps-control", "get_server_list"] in cards.read()["calls"]
    report = run_one(server, channel, request(3, action="destroy", vendor="nvidia-mps", device_id=GPU0))
    assert report["status"] == "completed"


def test_hami_create_and_destroy_through_the_channel(server, channel, cards):
    cards.hygon()
    report = run_one(server, channel, request(1, vendor="hygon-hami", memory_mb=4096, compute_percent=25))
    assert report["status"] == "completed", report
    assert report["result"]["device_id"] == "vdev0"
    assert report["result"]["handles"]["compute_units"] == 15  # 25 % of the card's 60
    assert cards.read()["vdevs"] == [{"id": 0, "device": 0, "compute_units": 15, "memory_mib": 4096}]
    report = run_one(server, channel, request(2, action="destroy", vendor="hygon-hami", device_id="vdev0"))
    assert report["status"] == "completed"
    assert report["result"]["destroyed"] == [{"uuid": "vdev0"}]
    assert cards.read()["vdevs"] == []


def test_an_unknown_vendor_is_refused(server, channel, cards):
    report = run_one(server, channel, request(vendor="acme-slicer"))
    assert report["status"] == "failed" and "no slice vendor 'acme-slicer'" in report["error"]


# --- the channel's own rules ------------------------------------------------------------


def test_a_lost_claim_runs_nothing_and_reports_nothing(server, channel, cards):
    cards.nvidia()
    offer(server, request())
    server.answer(f"{PATH}/1", (409, {"error": {"code": "conflict"}}))
    channel.poll()
    assert drain(channel) == [None]
    assert len(puts(server, 1)) == 1  # the claim only
    assert not [c for c in cards.calls("mig") if "-cgi" in c]


def test_a_report_that_does_not_get_through_is_kept_and_sent_again(server, channel, cards):
    cards.nvidia()
    offer(server, request())
    accept(server, 1, (503, {}), (503, {}), (200, {"id": 1}))
    channel.poll()
    assert drain(channel) == [False]
    assert 1 in channel.undelivered
    # the next round tries the kept report again first (the request itself is processing
    # on the server now: not offered again)
    offer(server)
    assert channel.poll() == []
    claim, *reports = puts(server, 1)
    assert len(reports) == 3 and reports[0] == reports[2]
    assert channel.undelivered == {}
    assert len([c for c in cards.calls("mig") if "-cgi" in c]) == 1


def test_a_report_answered_409_is_not_kept(server, channel, cards):
    cards.nvidia()
    offer(server, request())
    accept(server, 1, (409, {"error": {"code": "conflict", "message": "the request is timed_out"}}))
    channel.poll()
    assert drain(channel) == [True]
    assert channel.undelivered == {}


def test_a_request_already_queued_is_not_queued_twice(server, channel, cards):
    offer(server, request(1), request(2))
    offer(server, request(1), request(2), request(3))
    assert channel.poll() == [1, 2]
    assert channel.poll() == [3]


def test_at_most_five_a_round(server, channel):
    offer(server, *[request(i) for i in range(1, 9)])
    assert channel.poll() == [1, 2, 3, 4, 5]
    fetch = next(r for r in server.requests if r["method"] == "GET")
    assert "limit=5" in fetch["path"]


class Slow(Vendor):
    """A vendor that takes its time and counts how many of it run at once."""

    name = "slow"

    def __init__(self):
        super().__init__()
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.order: list[int] = []

    def execute(self, action, params, budget: Budget) -> Outcome:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.3)
        with self.lock:
            self.running -= 1
            self.order.append(params["n"])
        return Outcome(True)


def test_requests_run_one_at_a_time_in_order_and_the_poll_goes_on(server, client):
    slow = Slow()
    channel = SliceChannel("n1", client, vendors={"slow": slow}, poll_seconds=0.05)
    channel.report_client = client
    reqs = [dict(request(i, vendor="slow"), params={"n": i}) for i in (1, 2, 3)]
    offer(server, *reqs)
    for r in reqs:
        accept(server, r["id"])
    server.default = (200, {"results": []}, {})  # later polls: nothing new
    channel.start()
    try:
        deadline = time.monotonic() + 10
        while len(slow.order) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        polls = sum(1 for r in server.requests if r["method"] == "GET")
    finally:
        channel.close()
    assert slow.order == [1, 2, 3]
    assert slow.most == 1
    assert polls >= 5  # the poller kept its 50 ms rhythm while the worker was busy (~0.9 s)
    for r in reqs:
        assert puts(server, r["id"])[-1]["status"] == "completed"


def test_a_refused_key_is_not_logged_on_every_poll(server, channel, caplog):
    server.default = (401, {"error": {"code": "unauthorized"}}, {})
    with caplog.at_level("INFO"):
        assert channel.poll() == []
        assert channel.poll() == []
    assert sum("configuration error" in m for m in caplog.messages) == 1  # the client's, once
    assert not [m for m in caplog.messages if "could not fetch slice requests" in m]


def test_a_404_channel_is_logged_once(server, channel, caplog):
    with caplog.at_level("WARNING"):
        channel.poll()
        channel.poll()
    assert sum("has no slice channel" in m for m in caplog.messages) == 1


def test_the_agent_wires_the_channel_with_its_own_clients(tmp_path):
    cfg = AgentConfig(server_url="http://cp:8000", api_key="k", node_id="n1", data_dir=tmp_path, report_attempts=4)
    shared = ServerClient(cfg.server_url, cfg.api_key)
    channel = build_slice_channel(cfg, shared)
    assert channel.client is shared  # the agent's: a wrong key is logged once for all of it
    assert channel.report_client.attempts == 4 and channel.report_client is not shared
    assert set(channel.vendors) == {"nvidia-mig", "nvidia-mps", "hygon-hami"}
    assert channel.poll_seconds == 5.0 and channel.request_seconds == 120.0
    assert channel.tool_timeout == 60.0
