"""The agent and the server agree on the heartbeat: what the real agent builds (its
real GPU detection over a stand-in nvidia-smi reporting eight A100s, their health from
`nvidia-smi -q -d ECC,...` and an Xid line in the kernel log) goes through the server's
real heartbeat route and lands as the node the agent described."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apps.nodes import health
from apps.nodes.models import GpuHealthSample, Node
from apps.tasks import choices as task_choices
from apps.tasks import services as task_services
from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import ContainerEngine
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.detect import Detector
from heteroflow_agent.detect import health as agent_health
from heteroflow_agent.heartbeat import CACHED_MODELS_LABEL, Heartbeat, TaskReport
from heteroflow_agent.protocol import task_status

pytestmark = pytest.mark.django_db(transaction=True)  # the heartbeat route writes on its own connection
FIXTURES = Path(__file__).resolve().parents[2] / "agent" / "tests" / "fixtures" / "nvidia"
STAND_IN = """#!/bin/sh
case "$*" in
  *pci.bus_id*) cat "{fixtures}/query_bus_ids_8x_a100.csv" ;;
  *--query-gpu*) cat "{fixtures}/query_8x_a100.csv" ;;
  *topo*) cat "{fixtures}/topo_8x_nvswitch.txt" ;;
  *ECC*) cat "{fixtures}/q_health_8x_a100.txt" ;;
  *-q*) cat "{fixtures}/q_8x_a100.txt" ;;
  *) exit 64 ;;
esac
"""


@pytest.fixture
def eight_a100s(tmp_path):
    tools = tmp_path / "root" / "usr" / "bin"
    tools.mkdir(parents=True)
    tool = tools / "nvidia-smi"
    tool.write_text(STAND_IN.format(fixtures=FIXTURES))
    tool.chmod(0o755)
    # the kernel log the agent reads Xid events from (under the scratch root, so the
    # machine's own log, readable or not, cannot change the result)
    (tmp_path / "root" / "dev").mkdir()
    (tmp_path / "root" / "dev" / "kmsg").write_text((FIXTURES / "kmsg_xid_8x_a100.txt").read_text())
    return str(tmp_path / "root")


class NoEngine(ContainerEngine):
    def state(self):
        from heteroflow_agent.collect import EngineState

        return EngineState(False, "no container engine here")


def test_what_the_agent_sends_is_what_the_server_records(agents, eight_a100s, tmp_path):
    config = AgentConfig(
        server_url="http://testserver",
        api_key="unused",
        node_id="gpu-07",
        data_dir=tmp_path,
        allow_process_runtime=True,
        model_scan_dirs=(str(tmp_path),),
        labels={"rack": "r7"},
    )
    beat = Heartbeat(
        config,
        ServerClient("http://testserver", "unused"),
        detect_gpus=Detector(eight_a100s, 5.0).detect,
        engine=NoEngine(),
    )
    body = beat.payload()
    response = agents.send("gpu-07", body)
    assert response.status_code == 200, response.text
    assert response.json()["registered"] is True
    node = Node.objects.get(pk="gpu-07")
    assert (node.exec_mode, node.executable, node.gpu_type, node.gpu_count) == ("process", True, "nvidia", 8)
    assert node.labels["rack"] == "r7" and "heteroflow.io/gpu-topology" in node.labels
    gpus = list(node.gpus.order_by("index"))
    assert [g.index for g in gpus] == list(range(8))
    assert all(g.model.startswith("NVIDIA A100") and g.memory_total_mb for g in gpus)
    assert node.agent_version == "dev" and node.hostname == body["hostname"]
    # the cards' health: stored per card as read, absent fields absent (A100 retires no pages)
    assert [g.health["index"] for g in gpus] == list(range(8))
    assert gpus[2].health["ecc_uncorrected_aggregate"] == 1 and gpus[2].health["remapped_rows_uncorrectable"] == 1
    assert gpus[0].health["ecc_corrected_aggregate"] == 12 and "retired_pages_single_bit" not in gpus[0].health
    assert [e["code"] for e in gpus[5].health["xid_events"]] == [79] and gpus[4].health["xid_events"] == []
    assert node.health_hash == health.readings_hash(body["gpu_health"])
    assert body.get("cpu_sockets", 1) >= 1  # the CPU facts pass the schema (stored by the server's own step)
    # a second, steady beat is accepted too, and takes no health step (same hash)
    samples = GpuHealthSample.objects.filter(node_id="gpu-07").count()
    assert samples == 8
    assert agents.send("gpu-07", beat.payload()).status_code == 200
    assert GpuHealthSample.objects.filter(node_id="gpu-07").count() == samples


def test_served_models_and_the_cache_label_are_accepted_and_recorded(agents, eight_a100s, tmp_path):
    """What a serving engine has loaded (read from its real /v1/models) and the model
    cache label travel in the beat's schema and land on the node."""

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "qwen-tiny", "root": "/data/models/qwen-tiny"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    (tmp_path / "llama-tiny.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    config = AgentConfig(
        server_url="http://testserver",
        api_key="unused",
        node_id="gpu-08",
        data_dir=tmp_path,
        allow_process_runtime=True,
        model_scan_dirs=(str(tmp_path),),
    )
    port = engine.server_address[1]
    beat = Heartbeat(
        config,
        ServerClient("http://testserver", "unused"),
        detect_gpus=Detector(eight_a100s, 5.0).detect,
        engine=NoEngine(),
        tasks=lambda: TaskReport(serving={41: port}),
    )
    try:
        beat.payload()
        beat.loaded.wait(5)
        response = agents.send("gpu-08", beat.payload())
    finally:
        engine.shutdown()
        engine.server_close()
    assert response.status_code == 200, response.text
    node = Node.objects.get(pk="gpu-08")
    assert node.labels[CACHED_MODELS_LABEL] == "llama-tiny"
    served = [m for m in node.discovered_models if m.get("served")]
    assert served == [
        {"name": "qwen-tiny", "path": "/data/models/qwen-tiny", "served": True, "task_id": 41, "port": port}
    ]
    assert any(m["name"] == "llama-tiny" and m["format"] == "gguf" for m in node.discovered_models)


def test_the_agent_names_the_health_fields_as_the_server_stores_them():
    assert agent_health.COUNTERS == health.COUNTERS and agent_health.FLAGS == health.FLAGS


def test_the_agent_names_the_task_statuses_as_the_server_does():
    """One vocabulary: the statuses the agent reads and reports are the server's, its
    "ended on the server" is the server's TERMINAL, and every move it reports is one the
    server lets an agent make (a claim, an outcome, a confirmed stop or preemption)."""
    named = {value for name, value in vars(task_status).items() if name.isupper() and isinstance(value, str)}
    assert named and named <= set(task_choices.TaskStatus.values)
    assert task_status.TERMINAL == frozenset(task_choices.TERMINAL)
    for seen, reported in task_status.REPORTS.items():
        assert reported <= task_services.AGENT_MOVES[seen], f"the server refuses an agent's {seen} -> {reported}"
    outcomes = {task_status.ended(0), task_status.ended(1), task_status.ended(None)}
    assert outcomes == task_status.REPORTS[task_status.RUNNING]
