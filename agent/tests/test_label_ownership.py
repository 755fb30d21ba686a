"""The agent owns the labels it sends: every beat names their keys in `owned_label_keys`,
so the server removes one that a later beat leaves out (a label taken out of the
configuration, a topology no longer read). What the server does with them is tested
in tests/nodes/test_label_ownership.py."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import EngineState
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.heartbeat import CACHED_MODELS_LABEL, Heartbeat

SCHEMA = Path(__file__).resolve().parents[1] / "heteroflow_agent" / "protocol" / "heartbeat.schema.json"
TOPOLOGY = "heteroflow.io/gpu-topology"


@dataclass
class Detection:
    gpus: list = field(default_factory=list)
    collect_failures: list = field(default_factory=list)
    collector_error: str = ""
    capabilities: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    is_container: bool = False


class NoEngine:
    def state(self):
        return EngineState(False, "no container engine here")

    def image_tags(self):
        return []


def agent(server_url, tmp_path, labels, detection):
    config = AgentConfig(
        server_url=server_url,
        api_key="k",
        node_id="gpu-07",
        data_dir=Path(tmp_path),
        model_scan_dirs=(str(tmp_path),),
        labels=labels,
    )
    client = ServerClient(server_url, "k", attempts=1, sleep=lambda s: None)
    return Heartbeat(config, client, detect_gpus=lambda: detection, engine=NoEngine())


def test_every_label_the_agent_sends_is_one_it_owns(tmp_path):
    detection = Detection(labels={TOPOLOGY: "{}"})
    body = agent("http://unused", tmp_path, {"rack": "r1", "pool": "a"}, detection).payload()
    assert set(body["labels"]) == {"rack", "pool", TOPOLOGY, CACHED_MODELS_LABEL}
    assert body["owned_label_keys"] == sorted(body["labels"])


def test_a_label_taken_away_leaves_the_beat_and_the_owned_keys_together(server, tmp_path):
    """A restart with a label taken out of the configuration, and a topology the detector
    no longer reads: the beat names neither, so the server removes both."""
    server.answer("/api/v1/nodes/gpu-07/heartbeat", (200, {"status": "online"}), (200, {"status": "online"}))
    agent(server.url, tmp_path, {"rack": "r1", "pool": "a"}, Detection(labels={TOPOLOGY: "{}"})).beat()
    agent(server.url, tmp_path, {"rack": "r1"}, Detection()).beat()
    first, second = (request["json"] for request in server.requests)
    assert {"pool", TOPOLOGY} <= set(first["owned_label_keys"])
    assert second["owned_label_keys"] == sorted(second["labels"]) == sorted(["rack", CACHED_MODELS_LABEL])


def test_the_schema_describes_the_owned_keys_as_label_keys():
    schema = json.loads(SCHEMA.read_text())
    owned = schema["properties"]["owned_label_keys"]
    assert owned["type"] == "array" and owned["uniqueItems"] is True
    assert owned["maxItems"] == schema["properties"]["labels"]["maxProperties"]
    assert owned["items"]["pattern"] == schema["properties"]["labels"]["propertyNames"]["pattern"]
    assert "owned_label_keys" not in schema.get("required", [])  # an older agent does not send it
