"""A replica starts on a node that did not have its model: the whole control plane, a real
agent (process runtime) and llama.cpp (llama-cpp-python), with a `hub` model served by
a real HTTP mirror (Python's http.server in a thread, the tiny GGUF and its manifest).

The agent downloads the model into its model cache (checksum checked), reports it, the
service's history gets an `ensure` decision, the engine serves the cached copy; a
second service whose model the mirror does not have fails its replica saying why, in
the replica's error and in the service's decisions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
import requests
from django.conf import settings

from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.inference.selectors import replicas_of
from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant, issue_platform_key
from heteroflow_agent.runtime.process import ProcessRuntime
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until
from tests.llama import require_llama_cpp, write_tiny_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_mirror(root) -> tuple[ThreadingHTTPServer, str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def create_service(plane, key: str, name: str, model: str) -> InferenceService:
    answer = requests.post(
        f"{plane.url}/api/v1/inference-services",
        json={
            "tenant": "lab",
            "name": name,
            "model": model,
            "engine": "llama.cpp",
            "gpu_type": "virtual",
            "gpus_per_replica": 1,
            "min_replicas": 1,
            "max_replicas": 1,
            "engine_args": ["--n_ctx", "512"],
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return InferenceService.objects.get(pk=answer.json()["id"])


def test_a_llama_cpp_replica_starts_on_a_node_that_did_not_have_its_model(tmp_path):
    require_llama_cpp()
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks queued by earlier tests
    published = tmp_path / "mirror" / "org" / "tiny"
    weights = write_tiny_gguf(published / "tiny.gguf").read_bytes()
    listing = {"files": [{"path": "tiny.gguf", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}]}
    (published / "manifest.json").write_text(json.dumps(listing))
    mirror, mirror_url = serve_mirror(tmp_path / "mirror")
    data_dir, cache = tmp_path / "agent", tmp_path / "model-cache"
    plane = ControlPlane(tmp_path).start()
    agent = start_agent(
        plane.url,
        data_dir,
        HETEROFLOW_MODEL_HUB_URL=mirror_url,
        HETEROFLOW_MODEL_CACHE_DIR=str(cache),
        HETEROFLOW_MODEL_CACHE_BYTES=str(50 * 2**20),
        **QUICK,
    )

    def logs() -> str:
        return plane.logs() + f"\n--- agent\n{agent.log_path.read_text(errors='replace')[-4000:]}"

    try:
        wait_until(lambda: Node.objects.filter(status="online").count() == 1, 90, f"the node online\n{logs()}")
        assert not cache.exists()  # the node does not have the model
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        Model.objects.create(tenant=tenant, name="tiny", source_kind="hub", source="org/tiny", format="gguf")
        key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
        service = create_service(plane, key, "tiny-chat", "tiny")

        def healthy():
            return [row for row in replicas_of(service) if row["healthy"]]

        wait_until(healthy, 120, f"the replica serving ({replicas_of(service)})\n{logs()}")
        (row,) = healthy()
        cached = list(cache.glob("tiny-*/tiny.gguf"))
        assert len(cached) == 1 and cached[0].read_bytes() == weights
        listed = requests.get(f"{row['address']}/v1/models", timeout=10).json()
        assert [entry["id"] for entry in listed["data"]] == ["tiny"]
        argv = ProcessRuntime(data_dir / "process-tasks")._task(row["task_id"]).record["command"]
        assert argv[argv.index("--model") + 1] == str(cached[0])  # the engine loads the cached copy
        fetched = ServiceDecision.objects.get(service=service, source="ensure")
        assert fetched.action == "model_fetched" and f"{len(weights)} bytes" in fetched.reason

        # the node's one card freed for the next service
        stopped = requests.post(
            f"{plane.url}/api/v1/inference-services/{service.pk}/stop",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert stopped.status_code in (200, 202), stopped.text
        wait_until(
            lambda: Task.objects.get(pk=row["task_id"]).status == "stopped", 60, f"the replica stopped\n{logs()}"
        )

        # a model the mirror does not have: the replica fails saying why, and so does the history
        Model.objects.create(tenant=tenant, name="absent", source_kind="hub", source="org/absent", format="gguf")
        broken = create_service(plane, key, "absent-chat", "absent")
        wait_until(
            lambda: ServiceDecision.objects.filter(service=broken, action="ensure_failed").exists(),
            90,
            f"the failure in the service's decisions\n{logs()}",
        )
        reason = ServiceDecision.objects.filter(service=broken, action="ensure_failed").first().reason
        assert f"{mirror_url}/org/absent/manifest.json: HTTP 404" in reason
        wait_until(
            lambda: Task.objects.filter(group_id=broken.pk, status="failed").exists(),
            60,
            f"the replica failed\n{logs()}",
        )
        failed = Task.objects.filter(group_id=broken.pk, status="failed").first()
        assert failed.error_message.startswith("could not start: model absent:") and "HTTP 404" in failed.error_message
    finally:
        stop_process(agent)
        runtime = ProcessRuntime(data_dir / "process-tasks")
        for task_id in runtime.tasks():
            runtime.stop(task_id, 1)
            runtime.remove(task_id)
        plane.stop()
        mirror.shutdown()
        mirror.server_close()
