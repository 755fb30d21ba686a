"""A real inference engine under a real agent: llama.cpp's server (llama-cpp-python) with a
tiny GGUF model the test writes, launched by the agent's engine router on the process
runtime, against the whole control plane (web, Celery worker and beat).

- An inference task that names no command, only its `serving` (engine llama.cpp, model
  `tiny`, format gguf, the file's path): the scheduler gives it a host port, the agent
  builds the engine's command line, starts it, probes GET /v1/models until the node's
  task_health says healthy, reads what the engine loaded into discovered_models, and
  clients talk to it with the official `openai` client. Stopping the task stops the
  engine and frees its port.
- An inference service of 2 replicas on a node of two cards: both replicas serve; one
  replica's engine killed is rebuilt (the 10 s rebuild job requeues its slot) and serves
  again; idle, the service sleeps (replicas stopped, cards free, ports closed); woken
  through the gateway's path (the `inference.wake_service` job), it answers /v1/models
  again. Idle again, it lends both cards to a training of its tenant (put to sleep), the
  training runs on them; a request wakes it, the wake patrol preempts the training
  (graceful stop, requeued) and the replicas serve again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import openai
import pytest
import redis
import requests
from django.conf import settings

from apps.core.principals import Principal, PrincipalKind
from apps.gateway.services import create_key
from apps.inference import load_readings
from apps.inference.models import InferenceService, Model, ServiceDecision, ServiceLoan
from apps.inference.selectors import replicas_of
from apps.nodes.models import Node
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tasks.services import create_task, stop_task
from apps.tenants.services import create_tenant, issue_platform_key
from heteroflow_agent.runtime.process import ProcessRuntime
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until
from tests.llama import models_answer, require_llama_cpp, write_tiny_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}
OPERATOR = Principal(PrincipalKind.OPERATOR)

# nvidia-smi as the agent's detection runs it: two idle cards (one node, two replicas: each
# replica on its own card and its own host port)
CARD = "{index}, GPU-engine-{index}, NVIDIA A100-SXM4-80GB, 81920, 0, 0, 30, 60.0, 8.0"
STAND_IN = """#!/bin/sh
case "$*" in
  *--query-gpu*) printf '{cards}\\n' ;;
  *) exit 0 ;;
esac
"""


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
        # a probe of the engine while a stream is going (the agent reads /v1/models every
        # few seconds) must not cut the stream short: llama.cpp's server interrupts a
        # stream when another request waits for the model, unless launched with
        # --interrupt_requests false (the agent's default for it)
        chunks, probes = [], []
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=128, stream=True
        )
        for chunk in stream:
            if not chunks:
                probe = threading.Thread(target=lambda: probes.append(requests.get(f"{base}/v1/models", timeout=30)))
                probe.start()
                time.sleep(0.3)  # the probe waits for the model while the stream goes on
            chunks.append(chunk)
        probe.join()
        assert [p.status_code for p in probes] == [200]
        # one chunk ends the answer; the engine may send another after it (timings, usage)
        finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        assert chunks and finishes in (["length"], ["stop"]), [chunk.model_dump(exclude_none=True) for chunk in chunks]
        runtime = ProcessRuntime(data_dir / "process-tasks")
        argv = runtime._task(task.pk).record["command"]
        assert argv[1:3] == ["-m", "llama_cpp.server"] and "--model" in argv and "--model_alias" in argv
        assert argv[3:5] == ["--interrupt_requests", "false"]

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


def two_card_path(tmp_path) -> str:
    tools = tmp_path / "tools"
    tools.mkdir()
    cards = "\\n".join(CARD.format(index=i) for i in range(2))
    (tools / "nvidia-smi").write_text(STAND_IN.format(cards=cards))
    (tools / "nvidia-smi").chmod(0o755)
    return f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"


def address(row: dict) -> str:
    """Where a replica answers: the address the gateway uses, on this machine."""
    return row["address"] or f"http://127.0.0.1:{row['host_port']}"


def serving(service: InferenceService) -> list[dict]:
    """The replicas running and reported healthy, each answering /v1/models."""
    return [row for row in replicas_of(service) if row["healthy"] and models_answer(address(row))]


def test_a_service_of_two_llama_cpp_replicas_is_rebuilt_sleeps_and_wakes(tmp_path):
    require_llama_cpp()
    connection = redis.Redis.from_url(settings.REDIS_URL)
    connection.delete("celery")  # no ticks queued by earlier tests
    data_dir = tmp_path / "agent"
    model_path = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    plane = ControlPlane(tmp_path).start()
    agent = start_agent(plane.url, data_dir, PATH=two_card_path(tmp_path), **QUICK)

    def logs() -> str:
        return plane.logs() + f"\n--- agent\n{agent.log_path.read_text(errors='replace')[-4000:]}"

    try:
        wait_until(
            lambda: Node.objects.filter(status="online", gpu_type="nvidia", gpu_count=2).count() == 1,
            90,
            f"the node of two cards online\n{logs()}",
        )
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        Model.objects.create(tenant=tenant, name="tiny", source_kind="path", source=str(model_path), format="gguf")
        began = time.monotonic()
        key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
        answer = requests.post(
            f"{plane.url}/api/v1/inference-services",
            json={
                "tenant": "lab",
                "name": "tiny-chat",
                "model": "tiny",
                "engine": "llama.cpp",
                "gpu_type": "nvidia",
                "gpus_per_replica": 1,
                "min_replicas": 2,
                "max_replicas": 2,
                "engine_args": ["--n_ctx", "512"],
                "sleep_after_seconds": 60,
            },
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        service = InferenceService.objects.get(pk=answer.json()["id"])
        connection.delete(load_readings.inflight_key(service.pk))  # no gateway reading yet: it stays awake

        def state() -> str:
            service.refresh_from_db()
            return service.state

        # 1. two replicas serving, on their own cards and ports
        wait_until(lambda: len(serving(service)) == 2, 120, f"both replicas serving ({replicas_of(service)})\n{logs()}")
        wait_until(lambda: state() == "running", 30, f"the service running ({service.state})\n{logs()}")
        print(f"\n2 replicas of llama.cpp serving {time.monotonic() - began:.1f} s after the service was created")

        # through the gateway, with the official client and an endpoint key, as users call it
        endpoint_key = create_key(OPERATOR, tenant=tenant, name="e2e").key
        gateway = openai.OpenAI(base_url=f"{plane.url}/v1", api_key=endpoint_key, timeout=30, max_retries=0)

        def chat_through_gateway():
            try:
                return gateway.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
            except openai.APIStatusError:
                return None  # the gateway's routes not refreshed yet: asked again

        answer = wait_until(chat_through_gateway, 60, f"a chat through the gateway\n{logs()}")
        assert answer.choices and answer.usage.completion_tokens >= 1
        chunks = list(
            gateway.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
        )
        assert chunks and any(chunk.choices for chunk in chunks)
        assert [entry.id for entry in gateway.models.list().data] == ["tiny"]
        rows = replicas_of(service)
        assert sorted(row["rank"] for row in rows) == [0, 1]
        assert len({row["host_port"] for row in rows}) == 2
        assert sorted(GpuAllocation.objects.filter(task__group_id=service.pk).values_list("gpu_index", flat=True)) == [
            0,
            1,
        ]

        # 2. one replica's engine killed: the rebuild requeues its slot, it serves again
        victim = next(row for row in rows if row["rank"] == 0)
        runtime = ProcessRuntime(data_dir / "process-tasks")
        pid = runtime._task(victim["task_id"]).command["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def rebuilt():
            return ServiceDecision.objects.filter(
                service=service, source="rebuild", action="recreate", details__rank=0
            ).first()

        assert rebuilt() is None
        decision = wait_until(rebuilt, 60, f"the dead replica rebuilt ({replicas_of(service)})\n{logs()}")
        requeued_in = time.monotonic() - killed_at
        assert decision.details["task_id"] == victim["task_id"]
        wait_until(
            lambda: any(row["rank"] == 0 for row in serving(service)),
            90,
            f"the rebuilt replica serving ({replicas_of(service)})\n{logs()}",
        )
        serving_in = time.monotonic() - killed_at
        assert Task.objects.get(pk=victim["task_id"]).status == "running"  # the same slot, requeued
        print(f"a killed replica rebuilt {requeued_in:.1f} s after the kill, serving again after {serving_in:.1f} s")
        assert requeued_in <= 10 + 15  # the 10 s job, the agent's report and a busy 2-core machine

        # 3. idle: the gateway says nothing in flight and the last request was long ago
        wait_until(lambda: len(serving(service)) == 2, 60, f"both replicas serving again\n{logs()}")
        long_ago = service.state_changed_at - timedelta(seconds=120)
        idle_at = time.monotonic()

        def idle_then_asleep():
            # again each round: the gateway writes its last request time in batches, 10 s late
            connection.set(load_readings.inflight_key(service.pk), 0)
            InferenceService.objects.filter(pk=service.pk).exclude(state="sleeping").update(
                state_changed_at=long_ago, last_request_at=long_ago
            )
            return state() == "sleeping"

        wait_until(idle_then_asleep, 60, f"the idle service asleep ({service.state})\n{logs()}")
        replica_ids = [row["task_id"] for row in replicas_of(service)]
        wait_until(
            lambda: set(Task.objects.filter(pk__in=replica_ids).values_list("status", flat=True)) == {"stopped"},
            60,
            f"its replicas stopped ({replicas_of(service)})\n{logs()}",
        )
        assert not GpuAllocation.objects.filter(task_id__in=replica_ids).exists()  # the cards are free
        assert not any(models_answer(address(row)) for row in rows)
        print(f"idle, asleep with its cards free {time.monotonic() - idle_at:.1f} s after the gateway went quiet")

        # 4. a request through the gateway wakes it: answered 503 with Retry-After while it
        # wakes (the gateway enqueues inference.wake_service), then served again
        woken_at = time.monotonic()
        refusals = []

        def woken_through_gateway():
            try:
                gateway.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "wake up"}])
            except openai.APIStatusError as exc:
                refusals.append((exc.status_code, exc.response.headers.get("retry-after")))
            return state() in ("waking", "running")

        wait_until(woken_through_gateway, 30, f"the service woken by a request ({service.state})\n{logs()}")
        # the wake's answer is 503 with Retry-After; a 502 may come first, from routes the
        # gateway cached while the replicas were still up (its probe drops them within 10 s)
        assert refusals and refusals[-1][0] == 503 and refusals[-1][1], refusals
        assert {status for status, _ in refusals} <= {502, 503}, refusals
        wait_until(lambda: serving(service), 120, f"a woken replica serving ({replicas_of(service)})\n{logs()}")
        row = serving(service)[0]
        listed = requests.get(f"{address(row)}/v1/models", timeout=10).json()
        assert [entry["id"] for entry in listed["data"]] == ["tiny"]
        wait_until(lambda: state() == "running", 30, f"the woken service running ({service.state})\n{logs()}")
        print(f"woken: a replica answering /v1/models {time.monotonic() - woken_at:.1f} s after the wake was asked")
        assert wait_until(chat_through_gateway, 60, f"a chat through the gateway after the wake\n{logs()}").choices

        # 5. idle again, a training of the tenant asks for both cards: the idle service lends
        # them (put to sleep: its min is its count), the training runs on them under the
        # agent; a request through the gateway wakes the service, and the 15 s wake patrol
        # gives the cards back and preempts the training (the agent stops it and confirms,
        # it is requeued), so the replicas serve again
        wait_until(lambda: len(serving(service)) == 2, 90, f"both replicas serving after the wake\n{logs()}")
        lent_at = time.monotonic()
        borrower = create_task(
            tenant=tenant,
            name="borrower",
            kind="training",
            image="",
            command=[sys.executable, "-c", "import time; time.sleep(600)"],
            gpu_required=2,
            gpu_type="nvidia",
            timeout_seconds=600,
        )

        def borrowing():
            connection.set(load_readings.inflight_key(service.pk), 0)  # idle, whatever the gateway wrote
            borrower.refresh_from_db()
            return borrower.status == "running"

        wait_until(borrowing, 120, f"the training on the lent cards ({borrower.schedule_reason})\n{logs()}")
        assert state() == "sleeping"
        lent = ServiceDecision.objects.get(service=service, source="lending", action="borrowed")
        assert f"training task {borrower.pk} (borrower)" in lent.reason and "put to sleep" in lent.reason
        assert sorted(GpuAllocation.objects.filter(task=borrower).values_list("gpu_index", flat=True)) == [0, 1]
        print(
            f"lent: the training running on the service's cards {time.monotonic() - lent_at:.1f} s after it was queued"
        )
        reclaim_at = time.monotonic()
        wait_until(woken_through_gateway, 30, f"the lent service woken by a request ({service.state})\n{logs()}")

        def preempted():
            borrower.refresh_from_db()
            return borrower.status == "pending" and borrower.preempt_count == 1

        wait_until(preempted, 90, f"the training preempted and requeued ({borrower.status})\n{logs()}")
        loan = ServiceLoan.objects.get(service=service)
        assert loan.state == "returned" and "traffic" in loan.returned_why, loan.returned_why
        stop_task(borrower)  # it would wait for the cards again; the replicas take them
        wait_until(
            lambda: serving(service), 120, f"a replica serving after the reclaim ({replicas_of(service)})\n{logs()}"
        )
        print(f"reclaimed: a replica serving {time.monotonic() - reclaim_at:.1f} s after the request that woke it")
    finally:
        stop_process(agent)
        runtime = ProcessRuntime(data_dir / "process-tasks")
        for task_id in runtime.tasks():
            runtime.stop(task_id, 1)
            runtime.remove(task_id)
        plane.stop()
