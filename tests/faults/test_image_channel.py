"""The image channel end to end (issue 19): a live control plane (web, Celery worker and
beat, as `make up` runs them), real agents on a real engine (Podman's Docker API service,
scripts/container-engine.sh) and a real registry (Debian's distribution registry,
scripts/registry.sh). Without the registry or the engine this skips saying why; in CI
(HETEROFLOW_REQUIRE_REGISTRY=1) it fails instead.

- An operator's pull: the agent claims it, reports progress (the start report), pulls
  through the engine, and the request completes with the check of the pulled image.
- A check: exact (present with its image id and size; a missing tag absent) and a
  repository match (every local tag). A bare repository's pull (as :latest), and an old
  agent's (HETEROFLOW_IMAGE_LEGACY_LATEST) ":latest" answer to a bare check, accepted and
  stored under the reference asked.
- A stalled pull (a registry that accepts the connection and never answers): the agent
  reports no progress after the start; the janitor's sweep, run as at 10 minutes and a
  second after the last sign, fails it "stalled"; the agent's late final report is refused
  and changes nothing.
- Pulled but not there: an agent whose pulled image is removed before its check (its
  test hook HETEROFLOW_TEST_IMAGE_REMOVE_AFTER_PULL) reports "completed" with the honest
  check (present false); the server stores the request failed.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import jsonschema_rs
import pytest
import redis
import requests
from django.conf import settings

from agent.tests.channels.support import StallingRegistry, remove_test_images, require_engine, require_registry
from apps.core.clock import utcnow
from apps.nodes.choices import IMAGE_STALLED_SECONDS
from apps.nodes.images import PULLED_BUT_NOT_THERE, STALLED, sweep_image_requests
from apps.nodes.models import ImageRequest, Node
from apps.tenants.services import issue_platform_key
from heteroflow_agent.main import TEST_REMOVE_AFTER_PULL
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane
from tests.headers import AGENT_HTTP, bearer_http
from tests.live import agent_log, start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}
SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "agent/heteroflow_agent/protocol/image_channel.schema.json").read_text()
)


def contract(definition: str):
    """The live server's answers checked against the agent's contract."""
    schema = {key: value for key, value in SCHEMA.items() if key != "oneOf"}
    return jsonschema_rs.validator_for({**schema, "$ref": f"#/definitions/{definition}"})


REQUEST, AGENT_LIST, WATCHED = contract("request"), contract("agent_list"), contract("watched")


@pytest.fixture
def registry():
    return require_registry()


@pytest.fixture
def engine(registry):
    client = require_engine()
    remove_test_images(client, registry)
    yield client
    remove_test_images(client, registry)
    client.close()


def node_of(data_dir) -> str:
    path = data_dir / "node-id"
    wait_until(path.exists, 60, f"the agent's node id in {path}")
    return path.read_text().strip()


def test_pull_check_stall_and_pulled_but_not_there_with_a_real_agent_and_registry(tmp_path, registry, engine):
    # the worker must not chew through ticks queued by earlier tests
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")
    plane = ControlPlane(tmp_path).start()
    dirs = {"a": tmp_path / "agent-a", "b": tmp_path / "agent-b"}
    agents = {
        "a": start_agent(plane.url, dirs["a"], container_engine=True, **QUICK),
        # b answers like an old agent (a bare repository as :latest), and its pulled images
        # vanish before their check (the agent's test hook)
        "b": start_agent(
            plane.url,
            dirs["b"],
            container_engine=True,
            **QUICK,
            HETEROFLOW_IMAGE_LEGACY_LATEST="true",
            **{TEST_REMOVE_AFTER_PULL: "1"},
        ),
    }
    stalling = StallingRegistry()
    try:
        nodes = {name: node_of(data_dir) for name, data_dir in dirs.items()}
        wait_until(
            lambda: Node.objects.filter(pk__in=nodes.values(), status="online").count() == 2,
            90,
            f"both nodes online\n{plane.logs()}\n{agent_log(agents['a'])}",
        )
        for agent in agents.values():
            wait_until(lambda agent=agent: "image channel: polling" in agent_log(agent), 30, "the image channel")
        key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
        http = requests.Session()
        http.headers.update(bearer_http(key))

        def post(node: str, what: str, body: dict) -> dict:
            response = http.post(f"{plane.url}/api/v1/nodes/{node}/images/{what}", json=body, timeout=10)
            assert response.status_code == 202, response.text
            return response.json()

        def get(request_id: int) -> dict:
            response = http.get(f"{plane.url}/api/v1/image-requests/{request_id}", timeout=10)
            assert response.status_code == 200, response.text
            REQUEST.validate(response.json())
            return response.json()

        def finished(request_id: int, timeout: float = 120) -> dict:
            return wait_until(
                lambda: (row := get(request_id))["status"] in ("completed", "failed") and row,
                timeout,
                f"image request {request_id} finished\n{agent_log(agents['a'])[-3000:]}",
            )

        probe = f"{registry}/heteroflow/probe"

        # what the agent key reads is the contract's: the watched list and the pending list
        for node in nodes.values():
            watched = requests.get(f"{plane.url}/api/v1/nodes/{node}/images/watched", headers=AGENT_HTTP, timeout=10)
            assert watched.status_code == 200, watched.text
            WATCHED.validate(watched.json())
            assert watched.json()["node_id"] == node
            pending = requests.get(
                f"{plane.url}/api/v1/agent/image-requests",
                params={"node_id": node, "status": "pending"},
                headers=AGENT_HTTP,
                timeout=10,
            )
            assert pending.status_code == 200, pending.text
            AGENT_LIST.validate(pending.json())

        # an operator's pull: progress (the start report), then completed with its check
        pulled = finished(post(nodes["a"], "pull", {"reference": f"{probe}:2.0"})["id"])
        image = engine.images.get(f"{probe}:2.0")
        assert pulled["status"] == "completed", pulled
        assert pulled["progress"]["message"] == f"pulling {probe}:2.0" and pulled["progress_at"]
        assert pulled["claimed_at"] and pulled["finished_at"] and pulled["requested_by"]
        assert pulled["result"]["images"] == [
            {
                "reference": f"{probe}:2.0",
                "present": True,
                "match": "exact",
                "image_id": image.id,
                "size_bytes": image.attrs["Size"],
                "tags": [],
            }
        ]

        # a check: exact and repository match
        asked = [f"{probe}:2.0", f"{probe}:1.0", probe, f"{registry}/heteroflow/other"]
        checked = finished(post(nodes["a"], "check", {"references": asked})["id"])
        assert checked["status"] == "completed", checked
        items = {item["reference"]: item for item in checked["result"]["images"]}
        assert list(items) == asked
        assert items[f"{probe}:2.0"]["present"] and items[f"{probe}:2.0"]["image_id"] == image.id
        assert not items[f"{probe}:1.0"]["present"] and items[f"{probe}:1.0"]["image_id"] is None
        assert items[probe]["match"] == "repository"
        assert items[probe]["tags"] == [
            {"tag": f"{probe}:2.0", "image_id": image.id, "size_bytes": image.attrs["Size"]}
        ]
        assert items[f"{registry}/heteroflow/other"] | {"tags": None} == {
            "reference": f"{registry}/heteroflow/other",
            "present": False,
            "match": "repository",
            "image_id": None,
            "size_bytes": None,
            "tags": None,
        }

        # a bare repository's pull: :latest, proven by the repository match with its :latest
        bare = finished(post(nodes["a"], "pull", {"reference": probe})["id"])
        latest = engine.images.get(f"{probe}:latest")
        assert bare["status"] == "completed", bare
        (item,) = bare["result"]["images"]
        assert (item["reference"], item["match"], item["present"]) == (probe, "repository", True)
        assert [t["tag"] for t in item["tags"]] == [f"{probe}:2.0", f"{probe}:latest"]
        # an old agent answers the bare repository as :latest, exact; stored as asked
        old = finished(post(nodes["b"], "check", {"references": [probe]})["id"])
        assert old["status"] == "completed", old
        assert old["result"]["images"] == [
            {
                "reference": probe,
                "present": True,
                "match": "exact",
                "image_id": latest.id,
                "size_bytes": latest.attrs["Size"],
                "tags": [],
            }
        ]

        # a stalled pull: claimed, the start report, then nothing; the janitor judges it
        stalled_ref = f"{stalling.address}/heteroflow/probe:1.0"
        stalled = post(nodes["a"], "pull", {"reference": stalled_ref})
        wait_until(lambda: stalling.received > 0, 60, "the engine's request to the stalling registry")
        row = wait_until(
            lambda: (r := get(stalled["id"]))["status"] == "processing" and r["progress_at"] and r,
            30,
            "the stalled pull's start report",
        )
        assert row["progress"] == {
            "layers_done": 0,
            "layers_total": 0,
            "bytes_done": None,
            "bytes_total": None,
            "message": f"pulling {stalled_ref}",
        }
        # nothing moves on the agent's side: no progress beyond the start report
        assert get(stalled["id"])["progress_at"] == row["progress_at"]
        # the janitor's own sweep, run as at IMAGE_STALLED_SECONDS (10 minutes) and a
        # second after the start report: the real job runs it every minute
        last_sign = ImageRequest.objects.get(pk=stalled["id"]).progress_at
        swept = sweep_image_requests(now=last_sign + timedelta(seconds=IMAGE_STALLED_SECONDS + 1))
        assert swept["stalled"] == 1, swept
        closed = get(stalled["id"])
        assert (closed["status"], closed["error"]) == ("failed", STALLED)
        # the registry goes away: the agent's pull fails, and its late final report is refused
        stalling.release()
        wait_until(
            lambda: f"image request {stalled['id']}: the server refused failed" in agent_log(agents["a"]),
            90,
            "the agent's late final report refused",
        )
        assert (get(stalled["id"])["status"], get(stalled["id"])["error"]) == ("failed", STALLED)

        # pulled but not there: the agent says completed with its honest check; the server refuses
        gone = finished(post(nodes["b"], "pull", {"reference": f"{probe}:1.0"})["id"])
        assert gone["status"] == "failed", gone
        assert gone["error"].startswith(f"{PULLED_BUT_NOT_THERE}: "), gone["error"]
        assert gone["result"]["images"][0]["present"] is False
        assert f"{TEST_REMOVE_AFTER_PULL}=1: removing {probe}:1.0" in agent_log(agents["b"])
        assert f"{probe}:1.0" not in [t for i in engine.images.list() for t in i.attrs.get("RepoTags") or []]
        assert utcnow() < ImageRequest.objects.get(pk=gone["id"]).deadline
    finally:
        stalling.release()
        for agent in agents.values():
            stop_process(agent)
        plane.stop()
