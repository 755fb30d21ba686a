from dataclasses import dataclass, field
from pathlib import Path

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import EngineState
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.heartbeat import ENGINES_EVERY, MODELS_EVERY, Heartbeat, TaskReport
from heteroflow_agent.main import run
from heteroflow_agent.version import Version


@dataclass
class Detection:
    gpus: list = field(default_factory=list)
    collect_failures: list = field(default_factory=list)
    collector_error: str = ""
    capabilities: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    is_container: bool = False
    health: list | None = None


class Engine:
    def __init__(self, available=False, tags=()):
        self.available, self.tags, self.listed = available, list(tags), 0

    def state(self):
        return EngineState(True) if self.available else EngineState(False, "no container engine: socket missing")

    def image_tags(self):
        self.listed += 1
        return self.tags


def make(server_url, tmp_path, *, detection=None, engine=None, tasks=TaskReport, process_engines=None, **cfg):
    config = AgentConfig(
        server_url=server_url,
        api_key="k",
        node_id="gpu-07",
        data_dir=Path(tmp_path),
        model_scan_dirs=(str(tmp_path),),
        **cfg,
    )
    client = ServerClient(server_url, "k", attempts=2, sleep=lambda s: None)
    return Heartbeat(
        config,
        client,
        detect_gpus=lambda: detection or Detection(),
        engine=engine or Engine(),
        tasks=tasks,
        version=Version("1.2.3", "abc1234-dirty", "2026-11-29T10:00:00Z"),
        process_engines=process_engines,
    )


CARDS = [
    {
        "index": 0,
        "vendor": "nvidia",
        "temperature": 61.0,
        "memory_used_mb": 1000,
        "metrics_available": ["temperature", "memory_used_mb"],
    },
    {"index": 1, "vendor": "nvidia", "temperature": 70.0, "metrics_available": ["temperature"]},
]


def test_the_payload_says_what_was_read_and_leaves_out_what_was_not(tmp_path):
    beat = make(
        "http://unused",
        tmp_path,
        detection=Detection(gpus=CARDS, labels={"heteroflow.io/gpu-topology": "{}"}),
        labels={"rack": "r1"},
    )
    body = beat.payload()
    assert (body["node_id"], body["agent_version"], body["agent_git_commit"], body["agent_build_time"]) == (
        "gpu-07",
        "1.2.3",
        "abc1234-dirty",
        "2026-11-29T10:00:00Z",
    )
    assert body["gpu_temperature"] == 70.0 and body["gpu_memory_used_mb"] == 1000  # only the card that reported it
    # the cache label is always there: empty clears the last list (the server merges labels by key)
    assert body["labels"] == {"rack": "r1", "heteroflow.io/gpu-topology": "{}", "heteroflow.cache/models": ""}
    assert body["heartbeat_interval"] == 5 and body["cpu_cores"] >= 1 and body["memory_gb"] > 0
    assert "live_task_ids" not in body  # no executor: unknown, not "no tasks"
    quiet = make("http://unused", tmp_path).payload()
    assert "gpu_temperature" not in quiet and "gpu_memory_used_mb" not in quiet


HEALTH = [
    {
        "index": 1,
        "ecc_uncorrected_volatile": 2,
        "xid_events": [{"code": 79, "at": "2026-12-01T10:00:00Z", "text": "GPU has fallen off the bus"}],
        "available": ["ecc_uncorrected_volatile", "xid_events"],
    }
]
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 1
"""


def test_card_health_and_the_cpu_facts_travel_in_the_beat(tmp_path, monkeypatch):
    from heteroflow_agent import inventory

    (tmp_path / "cpuinfo").write_text(CPUINFO)
    monkeypatch.setattr(inventory, "CPUINFO", str(tmp_path / "cpuinfo"))
    body = make("http://unused", tmp_path, detection=Detection(gpus=CARDS, health=HEALTH)).payload()
    assert body["gpu_health"] == HEALTH
    assert (body["cpu_model"], body["cpu_sockets"]) == ("Intel(R) Xeon(R) Platinum 8480+", 2)


def test_no_health_and_no_cpu_facts_are_absent_not_empty(tmp_path, monkeypatch):
    from heteroflow_agent import inventory

    monkeypatch.setattr(inventory, "CPUINFO", str(tmp_path / "missing"))
    for detection in (Detection(gpus=CARDS), Detection(gpus=CARDS, health=[])):
        body = make("http://unused", tmp_path, detection=detection).payload()
        assert "gpu_health" not in body and "cpu_model" not in body and "cpu_sockets" not in body


@pytest.mark.parametrize(
    "available,allow_process,expected",
    [
        (True, False, ("docker", True, "")),
        (False, True, ("process", True, "")),
        (False, False, ("none", False, "no container engine: socket missing")),
    ],
)
def test_executability_follows_the_engine_and_the_operators_choice(tmp_path, available, allow_process, expected):
    body = make("http://unused", tmp_path, engine=Engine(available), allow_process_runtime=allow_process).payload()
    assert (body["exec_mode"], body["executable"], body["error_message"]) == expected
    assert body["docker_available"] is available


def test_engines_and_models_are_probed_at_start_and_every_few_beats(tmp_path):
    engine = Engine(True, ["vllm/vllm-openai:v0.9.2"])
    beat = make("http://unused", tmp_path, engine=engine)
    first = beat.payload()
    assert first["inference_engines"] == ["vllm"] and first["vllm_available"] is True
    (tmp_path / "m.gguf").write_bytes(b"")
    for _ in range(MODELS_EVERY):  # beat() counts; payload() alone does not
        beat.beats += 1
        body = beat.payload()
    assert [m["name"] for m in body["discovered_models"]] == ["m"]
    beat.beats = ENGINES_EVERY
    beat.payload()
    assert engine.listed == 2


def test_the_process_runtime_reports_the_engines_its_interpreter_has_not_the_images(tmp_path):
    asked = []

    def installed():
        asked.append(1)
        return (["llama.cpp"], {"llama.cpp": "0.3.36"}) if len(asked) > 1 else ([], {})

    engine = Engine(True, ["vllm/vllm-openai:v0.9.2"])  # an engine answering later does not switch the probe
    beat = make("http://unused", tmp_path, engine=engine, allow_process_runtime=True, process_engines=installed)
    assert beat.payload()["inference_engines"] == []
    beat.beats = 1
    assert beat.payload()["inference_engines"] == [] and len(asked) == 1  # probed every 20 beats
    beat.beats = ENGINES_EVERY
    body = beat.payload()
    assert (body["inference_engines"], body["inference_engine_versions"]) == (["llama.cpp"], {"llama.cpp": "0.3.36"})
    assert engine.listed == 0 and beat.engines == (["llama.cpp"], {"llama.cpp": "0.3.36"})


def test_a_beat_posts_to_the_node_and_returns_the_answer(server, tmp_path):
    answer = {"node_id": "gpu-07", "status": "online", "registered": True, "scheduled_tasks": [], "server_time": "t"}
    server.answer("/api/v1/nodes/gpu-07/heartbeat", (503, {}), (200, answer))
    beat = make(
        server.url, tmp_path, tasks=lambda: TaskReport(live_task_ids=[3], task_health=[{"task_id": 3, "healthy": True}])
    )
    assert beat.beat() == answer
    sent = server.requests[-1]
    assert sent["method"] == "POST" and sent["json"]["node_id"] == "gpu-07" and sent["json"]["live_task_ids"] == [3]
    assert len(server.requests) == 2  # the 503 was retried


def test_an_undelivered_beat_is_dropped_not_queued(server, tmp_path):
    server.answer("/api/v1/nodes/gpu-07/heartbeat", (503, {}), (503, {}), (200, {"status": "online"}))
    beat = make(server.url, tmp_path)
    assert beat.beat() is None  # two attempts spent
    assert beat.beat() == {"status": "online"}  # the next interval sends one fresh beat
    assert len(server.requests) == 3


def test_a_refused_beat_is_reported(server, tmp_path, caplog):
    server.answer("/api/v1/nodes/gpu-07/heartbeat", (400, {"error": {"code": "invalid"}}))
    assert make(server.url, tmp_path).beat() is None
    assert "heartbeat refused: HTTP 400" in caplog.text


class FakeClock:
    def __init__(self):
        self.now = 100.0


class Stop:
    """Stops after `beats` waits; records how long each wait was."""

    def __init__(self, clock, beats):
        self.clock, self.left, self.waits = clock, beats, []

    def is_set(self):
        return self.left <= 0

    def wait(self, seconds):
        self.waits.append(round(seconds, 3))
        self.clock.now += seconds
        self.left -= 1


def test_a_slow_beat_skips_the_missed_slots_instead_of_bursting():
    clock = FakeClock()
    durations = iter([1.0, 12.0, 1.0])

    class Slow:
        config = AgentConfig(
            server_url="http://x", api_key="k", node_id="n", data_dir=Path("/tmp"), heartbeat_interval=5
        )

        def beat(self):
            clock.now += next(durations)

    stop = Stop(clock, 3)
    run(Slow(), stop, clock=lambda: clock.now)
    # on time: wait out the rest of 5 s; overran by 7 s: wait a full interval, no catch-up burst
    assert stop.waits == [4.0, 5.0, 4.0]


def interfaces(monkeypatch, addresses: dict, up=()):
    """psutil's view of the host's interfaces: {name: [(family, address, netmask)]},
    family "inet" or "link"."""
    import socket
    from types import SimpleNamespace

    from heteroflow_agent import collect

    families = {"inet": socket.AF_INET, "link": collect.psutil.AF_LINK}
    monkeypatch.setattr(
        collect.psutil,
        "net_if_addrs",
        lambda: {
            name: [
                SimpleNamespace(family=families[family], address=address, netmask=mask)
                for family, address, mask in rows
            ]
            for name, rows in addresses.items()
        },
    )
    monkeypatch.setattr(
        collect.psutil, "net_if_stats", lambda: {name: SimpleNamespace(isup=name in up) for name in addresses}
    )


def test_the_internal_address_travels_with_its_interfaces_prefix_length(tmp_path, monkeypatch):
    interfaces(
        monkeypatch,
        {
            "docker0": [("inet", "172.17.0.1", "255.255.0.0")],
            "eth0": [("inet", "192.168.5.10", "255.255.255.0"), ("link", "AA:BB:CC:00:11:22", None)],
            "eth1": [("inet", "10.9.0.3", "255.255.0.0")],
        },
        up=("docker0", "eth0", "eth1"),
    )
    body = make("http://unused", tmp_path).payload()
    assert (body["internal_ip"], body["internal_prefix"], body["mac"]) == ("192.168.5.10", 24, "AA:BB:CC:00:11:22")


def test_an_address_without_a_usable_netmask_is_sent_without_a_prefix(tmp_path, monkeypatch):
    interfaces(
        monkeypatch,
        {"eth0": [("inet", "10.0.0.7", "255.0.255.0")], "lo": [("inet", "127.0.0.1", "255.0.0.0")]},
        up=("eth0", "lo"),
    )
    body = make("http://unused", tmp_path).payload()
    assert body["internal_ip"] == "10.0.0.7" and "internal_prefix" not in body


def test_no_real_interface_up_sends_no_address(tmp_path, monkeypatch):
    interfaces(
        monkeypatch,
        {"eth0": [("inet", "10.0.0.7", "255.255.255.0")], "lo": [("inet", "127.0.0.1", "255.0.0.0")]},
        up=("lo",),
    )
    body = make("http://unused", tmp_path).payload()
    assert "internal_ip" not in body and "internal_prefix" not in body and "mac" not in body
