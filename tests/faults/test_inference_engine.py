"""A real inference engine under a real agent: llama.cpp's server (llama-cpp-python) with a
tiny GGUF model the test writes, launched by the agent's engine router on the process
runtime, against the whole control plane (web, Celery worker and beat).

An inference task that names no command, only its `serving` (engine llama.cpp, model
`tiny`, format gguf, the file's path): the scheduler gives it a host port, the agent
builds the engine's command line, starts it, probes GET /v1/models until the node's
task_health says healthy, reads what the engine loaded into discovered_models, and
clients talk to it with the official `openai` client. Stopping the task stops the
engine and frees its port.
"""

from __future__ import annotations

import time

import pytest
import redis
import requests
from django.conf import settings

from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tasks.services import create_task, stop_task
from apps.tenants.services import create_tenant
from heteroflow_agent.runtime.process import ProcessRuntime
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until
from tests.llama import require_llama_cpp, write_tiny_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}


def healthy_on_node(task: Task) -> bool | None:
    """The latest task_health the task's node reported for it (None: not reported)."""
    node = Node.objects.get(pk=task.node_id)
    return next((entry["healthy"] for entry in node.task_health if entry.get("task_id") == task.pk), None)


def served_on_node(task: Task) -> list[dict]:
    node = Node.objects.get(pk=task.node_id)
    return [m for m in node.discovered_models if m.get("served") and m.get("task_id") == task.pk]


def test_the_agent_launches_llama_cpp_for_a_serving_task_and_clients_talk_to_it(tmp_path):
    require_llama_cpp()
    import openai

    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks queued by earlier tests
    data_dir = tmp_path / "agent"
    model = write_tiny_gguf(data_dir / "models" / "tiny.gguf")  # where the agent's scanner looks
    plane = ControlPlane(tmp_path).start()
    agent = start_agent(plane.url, data_dir, **QUICK)

    def logs() -> str:
        return plane.logs() + f"\n--- agent\n{agent.log_path.read_text(errors='replace')[-4000:]}"

    try:
        wait_until(lambda: Node.objects.filter(status="online").count() == 1, 90, f"the node online\n{logs()}")
        node = Node.objects.get()
        assert "llama.cpp" in node.inference_engines, node.inference_engines  # the process runtime's probe
        assert any(m.get("name") == "tiny" and m.get("format") == "gguf" for m in node.discovered_models)
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        began = time.monotonic()
        task = create_task(
            tenant=tenant,
            name="tiny-llama",
            kind="inference",
            image="",
            command=[],
            gpu_required=1,  # the node's virtual card
            timeout_seconds=600,
            serving={
                "engine": "llama.cpp",
                "model": "tiny",
                "format": "gguf",
                "source": str(model),
                "args": ["--n_ctx", "512"],
            },
        )

        def running():
            task.refresh_from_db()
            return task.status == "running" and task.host_port

        wait_until(running, 90, f"the task running ({task.status}: {task.error_message})\n{logs()}")
        wait_until(lambda: healthy_on_node(task), 90, f"the node reporting the engine healthy\n{logs()}")
        healthy_in = time.monotonic() - began
        wait_until(lambda: served_on_node(task), 60, f"discovered_models listing what it serves\n{logs()}")
        assert served_on_node(task) == [
            {"name": "tiny", "path": "tiny", "served": True, "task_id": task.pk, "port": task.host_port}
        ]

        base = f"http://127.0.0.1:{task.host_port}"
        listed = requests.get(f"{base}/v1/models", timeout=10).json()
        assert [entry["id"] for entry in listed["data"]] == ["tiny"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=30)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert answer.choices[0].message.role == "assistant"
        assert answer.usage.completion_tokens >= 1
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4, stream=True
            )
        )
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
        runtime = ProcessRuntime(data_dir / "process-tasks")
        argv = runtime._task(task.pk).record["command"]
        assert argv[1:4] == ["-m", "llama_cpp.server", "--model"] and "--model_alias" in argv

        stop_task(task)
        wait_until(lambda: Task.objects.get(pk=task.pk).status == "stopped", 60, f"the task stopped\n{logs()}")
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{base}/v1/models", timeout=5)
        print(f"\nllama.cpp launched by the agent and healthy {healthy_in:.1f} s after the task was created")
    finally:
        stop_process(agent)
        runtime = ProcessRuntime(data_dir / "process-tasks")
        for task_id in runtime.tasks():
            runtime.stop(task_id, 1)
            runtime.remove(task_id)
        plane.stop()
