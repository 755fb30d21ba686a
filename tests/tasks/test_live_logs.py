"""Live task logs (apps.tasks.logs, docs/tasks.md#logs): an agent's batches through the real
ingestion route, read back and followed through the real ASGI application (the follow is
a text/event-stream served by Django under ASGI, fed by Redis pub/sub and the table). The
routes have connection pools of their own, hence committed data (transactional tests)."""

import asyncio
import gzip
import threading
import time
from datetime import timedelta

import httpx
import orjson
import pytest
import requests
from django.db import connection

from apps.core.clock import utcnow
from apps.core.principals import Principal, PrincipalKind
from apps.tasks import log_stream, logs, services
from apps.tasks.api.log_route import LogIngestApp
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task, TaskLogState
from apps.tenants import services as tenants
from apps.tenants.choices import Role
from tests.factories import UserFactory, make_group, make_node, make_task
from tests.headers import AGENT_HTTP, bearer_http
from tests.live import free_port, start_control_plane, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


class Loop:
    """An event loop of its own, and the routes' pools closed with it."""

    def __init__(self, app):
        self.app = app
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def client(self):
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://testserver", timeout=60)

    def close(self):
        async def close_all():
            route = self.app
            while route is not None:  # the thin routes, each in front of the next
                if hasattr(route, "close"):
                    await route.close()
                route = getattr(route, "fallback", None)
            if isinstance(self, Reader):
                await log_stream._pool.close()

        self.run(close_all())
        self.loop.close()


class Agent(Loop):
    """An agent's batches through the real ingestion route (on a loop of its own)."""

    def __init__(self):
        async def django(scope, receive, send):
            raise AssertionError(f"the log route handed {scope['path']} on")

        super().__init__(LogIngestApp(django))

    def ship(self, node_id, tasks, *, compress=True, headers=AGENT_HTTP, content=None):
        body = content if content is not None else orjson.dumps({"tasks": tasks})
        sent = dict(headers)
        if compress:
            body, sent["Content-Encoding"] = gzip.compress(body), "gzip"

        async def go():
            async with self.client() as client:
                return await client.post(f"/api/v1/nodes/{node_id}/logs", content=body, headers=sent)

        return self.run(go())


class Reader(Loop):
    """People reading and following logs through the whole ASGI application."""

    def __init__(self):
        from heteroflow.asgi import application

        super().__init__(application)

    def get(self, path, key, **params):
        async def go():
            async with self.client() as client:
                return await client.get(path, params=params, headers=bearer_http(key))

        return self.run(go())


@pytest.fixture
def agent():
    agent = Agent()
    yield agent
    agent.close()


@pytest.fixture
def reader():
    reader = Reader()
    yield reader
    reader.close()


@pytest.fixture
def people():
    """Two tenants, a member key in each; committed, and taken away afterwards."""
    made, keys = [], {}
    for slug in ("logs-a", "logs-b"):
        tenant = tenants.create_tenant(name=slug, slug=slug)
        user = UserFactory(username=f"{slug}-member")
        tenants.add_member(tenant, username=user.username, role=Role.MEMBER)
        owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
        keys[slug] = tenants.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="k").key
        made.append(tenant)
    yield made, keys
    for tenant in made:
        Task.objects.filter(tenant=tenant).delete()
        tenants.delete_tenant(tenant)


@pytest.fixture
def running(people):
    node = make_node("log-node", gpus=1)
    task = make_task(people[0][0], status=TaskStatus.RUNNING, node=node, gpu_required=0)
    yield task
    Task.objects.filter(node=node).delete()
    node.delete()


def lines(*texts, start=0, at=None, stream="stdout"):
    at = at or time.time()
    return [[start + i, at + i * 0.001, stream, text] for i, text in enumerate(texts)]


def stored(task_id):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.base + (e.line->>0)::bigint, e.line->>3 FROM task_log_chunks AS c"
            " CROSS JOIN LATERAL json_array_elements(c.lines::json) AS e(line) WHERE c.task_id = %s ORDER BY 1",
            [task_id],
        )
        return cursor.fetchall()


def stored_chunk_bytes(task_id):
    with connection.cursor() as cursor:
        cursor.execute("SELECT COALESCE(sum(bytes), 0) FROM task_log_chunks WHERE task_id = %s", [task_id])
        return cursor.fetchone()[0]


def test_a_batch_sent_twice_is_stored_once_and_read_in_order(agent, reader, people, running):
    batch = [{"task_id": running.pk, "run": "r1", "lines": lines("epoch 1", "epoch 2", "epoch 3")}]
    first = agent.ship("log-node", batch)
    assert first.status_code == 200 and first.json() == {"tasks": {str(running.pk): 3}, "refused": []}
    # the answer was lost: the agent sends the batch again, with one more line
    again = [{"task_id": running.pk, "run": "r1", "lines": lines("epoch 1", "epoch 2", "epoch 3", "epoch 4")}]
    assert agent.ship("log-node", again, compress=False).json()["tasks"] == {str(running.pk): 4}
    assert stored(running.pk) == [(1, "epoch 1"), (2, "epoch 2"), (3, "epoch 3"), (4, "epoch 4")]

    key = people[1]["logs-a"]
    page = reader.get(f"/api/v1/tasks/{running.pk}/logs", key, limit=2).json()
    assert [line["text"] for line in page["lines"]] == ["epoch 1", "epoch 2"] and page["next"] == 2
    rest = reader.get(f"/api/v1/tasks/{running.pk}/logs", key, after=page["next"]).json()
    assert [line["seq"] for line in rest["lines"]] == [3, 4] and rest["status"] == "running"
    tail = reader.get(f"/api/v1/tasks/{running.pk}/logs", key, tail=1).json()
    assert [line["text"] for line in tail["lines"]] == ["epoch 4"]
    assert reader.get(f"/api/v1/tasks/{running.pk}/logs", people[1]["logs-b"]).status_code == 404


def test_a_new_run_continues_the_tasks_numbering(agent, reader, people, running):
    agent.ship("log-node", [{"task_id": running.pk, "run": "r1", "lines": lines("a", "b")}])
    # requeued and run again (here on the same node): the agent numbers the new run from 0
    answer = agent.ship("log-node", [{"task_id": running.pk, "run": "r2", "lines": lines("c", "d", "e")}])
    assert answer.json()["tasks"] == {str(running.pk): 3}
    assert stored(running.pk) == [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]
    # a resend of the new run's lines is still recognised
    agent.ship("log-node", [{"task_id": running.pk, "run": "r2", "lines": lines("d", "e", "f", start=1)}])
    assert [seq for seq, _ in stored(running.pk)] == [1, 2, 3, 4, 5, 6]


def test_another_nodes_task_is_refused_and_nothing_of_it_is_stored(agent, reader, people, running):
    other = make_node("log-other", gpus=1)
    elsewhere = make_task(people[0][0], status=TaskStatus.RUNNING, node=other, gpu_required=0)
    answer = agent.ship(
        "log-node",
        [
            {"task_id": elsewhere.pk, "run": "r", "lines": lines("not mine")},
            {"task_id": running.pk, "run": "r", "lines": lines("mine")},
            {"task_id": 987654321, "run": "r", "lines": lines("no such task")},
        ],
    )
    assert answer.json() == {"tasks": {str(running.pk): 1}, "refused": [elsewhere.pk, 987654321]}
    assert stored(elsewhere.pk) == [] and stored(running.pk) == [(1, "mine")]
    elsewhere.delete()
    other.delete()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tasks": "x"}, "tasks"),
        ({"tasks": [{"task_id": 0, "run": "r", "lines": []}]}, "tasks[0].task_id"),
        ({"tasks": [{"task_id": 1, "run": "", "lines": []}]}, "tasks[0].run"),
        ({"tasks": [{"task_id": 1, "run": "r", "lines": [[0, 1.0, "stdin", "x"]]}]}, "tasks[0].lines[0]"),
        ({"tasks": [{"task_id": 1, "run": "r", "lines": [[-1, 1.0, "stdout", "x"]]}]}, "tasks[0].lines[0]"),
        ({"tasks": [{"task_id": 1, "run": "r", "lines": [[0, 1.0, "stdout"]]}]}, "tasks[0].lines[0]"),
        # the compiled check takes 2.0 for an integer; the walk does not
        ({"tasks": [{"task_id": 1, "run": "r", "lines": [[2.0, 1.0, "stdout", "x"]]}]}, "tasks[0].lines[0]"),
        ({"tasks": [{"task_id": 1, "run": "r", "lines": [[0, 1.0, "stdout", "x", "y"]]}]}, "tasks[0].lines[0]"),
    ],
)
def test_a_bad_batch_is_refused_whole_naming_the_field(agent, reader, running, body, field):
    good = {"task_id": running.pk, "run": "r", "lines": lines("fine")}

    sent = {"tasks": [good, *body["tasks"]]} if isinstance(body["tasks"], list) else body
    answer = agent.ship("log-node", None, content=orjson.dumps(sent), compress=False)
    assert answer.status_code == 400
    fields = answer.json()["error"]["fields"]
    expected = field if field == "tasks" else field.replace("tasks[0]", "tasks[1]")
    assert expected in fields
    assert stored(running.pk) == []


def test_the_route_takes_only_the_agent_key_and_whole_gzip(agent, reader, running):
    batch = [{"task_id": running.pk, "run": "r", "lines": lines("x")}]
    assert agent.ship("log-node", batch, headers={}).status_code == 401
    assert agent.ship("log-node", batch, headers={"X-API-Key": "wrong"}).status_code == 401

    damaged = gzip.compress(orjson.dumps({"tasks": batch}))[:-8]
    headers = AGENT_HTTP | {"Content-Encoding": "gzip"}
    assert agent.ship("log-node", None, content=damaged, compress=False, headers=headers).status_code == 400
    assert stored(running.pk) == []


def test_a_nul_and_an_overlong_line_are_stored_cleaned(agent, reader, running):
    long = "y" * (logs.MAX_LINE_CHARS + 10)
    agent.ship("log-node", [{"task_id": running.pk, "run": "r", "lines": lines("a\x00b", long)}])
    assert stored(running.pk) == [(1, "a\ufffdb"), (2, "y" * logs.MAX_LINE_CHARS)]


def test_lines_that_do_not_rise_within_a_batch_are_skipped_as_resends(agent, reader, people, running):
    batch = lines("a", "b", "c", "d")
    batch[2][0] = 0  # "c" numbered below "b": skipped, as the resend of a line the store has
    answer = agent.ship("log-node", [{"task_id": running.pk, "run": "r", "lines": batch}])
    assert answer.json()["tasks"] == {str(running.pk): 4}
    assert stored(running.pk) == [(1, "a"), (2, "b"), (4, "d")]
    page = reader.get(f"/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"], after=1).json()
    assert [(line["seq"], line["text"]) for line in page["lines"]] == [(2, "b"), (4, "d")]


def test_a_batch_of_several_tasks_is_stored_one_chunk_a_task(agent, reader, people, running):
    second = make_task(people[0][0], status=TaskStatus.RUNNING, node=running.node, gpu_required=0)
    agent.ship(
        "log-node",
        [
            {"task_id": second.pk, "run": "r", "lines": lines("x1", "x2")},
            {"task_id": running.pk, "run": "r", "lines": lines("a", "b", "c")},
            {"task_id": running.pk, "run": "r", "lines": lines("d", start=3)},  # a task's second batch
        ],
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT task_id, first_seq, last_seq FROM task_log_chunks WHERE task_id IN (%s, %s) ORDER BY 1, 2",
            [running.pk, second.pk],
        )
        chunks = cursor.fetchall()
    assert sorted(chunks) == sorted([(running.pk, 1, 3), (running.pk, 4, 4), (second.pk, 1, 2)])
    tail = reader.get(f"/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"], tail=2).json()
    assert [line["text"] for line in tail["lines"]] == ["c", "d"]
    second.delete()


def test_a_task_over_its_bound_is_trimmed_oldest_first(agent, reader, running, settings):
    settings.HETEROFLOW_TASK_LOG_MAX_BYTES = 65_536
    chunk = "z" * 1023
    for start in range(0, 100, 20):  # 100 lines of 1 KB: past 64 KB by more than a quarter
        agent.ship("log-node", [{"task_id": running.pk, "run": "r", "lines": lines(*[chunk] * 20, start=start)}])
    assert logs.trim(running.pk) is True
    kept = stored(running.pk)
    assert kept[-1][0] == 100 and 60 <= len(kept) <= 64
    state = TaskLogState.objects.get(task_id=running.pk)
    assert state.first_seq == kept[0][0] and state.stored_bytes == stored_chunk_bytes(running.pk)
    assert state.stored_bytes <= 65_536
    assert logs.trim(running.pk) is False  # within its bound now


def test_retention_drops_whole_days_of_lines(agent, reader, running, settings):
    settings.HETEROFLOW_TASK_LOG_RETENTION_DAYS = 1
    agent.ship("log-node", [{"task_id": running.pk, "run": "r", "lines": lines("old")}])
    later = utcnow() + timedelta(days=3)
    result = logs.prune_and_prepare_partitions(now=later)
    assert logs.TASK_LOG_CHUNKS.partition_name(utcnow().date()) in result["dropped"]
    assert stored(running.pk) == []


@pytest.fixture(scope="module")
def plane(django_db_setup, django_db_blocker):
    """A live control plane (uvicorn) on the test database: a follow is a stream that
    only a real server sends while it is being written."""
    with django_db_blocker.unblock():
        server, url = start_control_plane()
    yield url
    stop_process(server)


class Follower(threading.Thread):
    """`hf logs -f` as any client would: a text/event-stream read line by line."""

    def __init__(self, url, key, headers=None):
        super().__init__(daemon=True)
        self.url, self.key, self.headers = url, key, headers or {}
        self.events, self.status, self.error = [], None, None

    def run(self):
        try:
            with requests.get(
                self.url,
                params={"follow": "true"},
                headers=bearer_http(self.key) | self.headers,
                stream=True,
                timeout=30,
            ) as response:
                self.status = response.status_code
                self.content_type = response.headers.get("content-type", "")
                kind, event_id = None, None
                for line in response.iter_lines(decode_unicode=True):
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("id: "):
                        event_id = line[4:]
                    elif line.startswith("data: "):
                        self.events.append((kind, event_id, orjson.loads(line[6:])))
                        if kind == "end":
                            return
                    elif not line:
                        kind, event_id = None, None
        except Exception as exc:  # noqa: BLE001
            self.error = exc

    def texts(self):
        return [line["text"] for kind, _, data in self.events if kind == "lines" for line in data["lines"]]

    def wait_for(self, count, timeout=10):
        wait_until(lambda: len(self.texts()) >= count or not self.is_alive(), timeout, f"{count} lines followed")
        return self.texts()


def ship(url, node_id, tasks):
    body = gzip.compress(orjson.dumps({"tasks": tasks}))
    answer = requests.post(
        f"{url}/api/v1/nodes/{node_id}/logs",
        data=body,
        headers=AGENT_HTTP | {"Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def finish(task):
    services.move_tasks(task.pk, [TaskStatus.RUNNING], TaskStatus.COMPLETED, exit_code=0)


def test_a_follower_gets_the_lines_as_they_come_then_the_end(plane, people, running):
    ship(plane, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("before")}])
    follower = Follower(f"{plane}/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"])
    follower.start()
    assert follower.wait_for(1) == ["before"]
    for n in (1, 2):
        shipped = time.monotonic()
        ship(plane, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines(f"live {n}", start=n)}])
        assert follower.wait_for(n + 1)[-1] == f"live {n}"
        # pushed through Redis, not found by the table read every 5 s
        assert time.monotonic() - shipped < log_stream.poll_seconds() / 2
    finish(running)
    follower.join(10)
    assert follower.status == 200 and follower.content_type.startswith("text/event-stream")
    assert follower.texts() == ["before", "live 1", "live 2"]
    assert follower.events[-1] == ("end", None, {"status": "completed", "exit_code": 0})
    assert [event_id for kind, event_id, _ in follower.events if kind == "lines"] == ["1", "2", "3"]


def test_a_follower_reconnecting_with_last_event_id_gets_no_line_twice(plane, people, running):
    ship(plane, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("one", "two", "three")}])
    follower = Follower(f"{plane}/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"], {"Last-Event-ID": "2"})
    follower.start()
    assert follower.wait_for(1) == ["three"]
    ship(plane, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("four", start=3)}])
    finish(running)
    follower.join(10)
    assert follower.texts() == ["three", "four"] and follower.events[-1][0] == "end"


def test_an_accept_header_alone_asks_for_the_stream(plane, people, running):
    ship(plane, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("via accept")}])
    finish(running)
    response = requests.get(
        f"{plane}/api/v1/tasks/{running.pk}/logs",
        headers=bearer_http(people[1]["logs-a"]) | {"Accept": "text/event-stream"},
        timeout=30,
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert "via accept" in response.text and "event: end" in response.text


def test_open_follows_hold_no_database_connection_of_the_web_process(people, running):
    """More followers than the web process has Django connections (2 here): each is
    served, since a follow gives its request's connection back before it streams."""
    server, url = start_control_plane(env={"HETEROFLOW_DB_POOL_SIZE": "2"})
    try:
        followers = [Follower(f"{url}/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"]) for _ in range(6)]
        for follower in followers:
            follower.start()
        ship(url, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("to all six")}])
        for follower in followers:
            assert follower.wait_for(1) == ["to all six"], (follower.status, follower.error)
        finish(running)
        for follower in followers:
            follower.join(15)
            assert follower.status == 200 and follower.events[-1][0] == "end"
    finally:
        stop_process(server)


def test_another_tenants_follower_gets_404(plane, people, running):
    follower = Follower(f"{plane}/api/v1/tasks/{running.pk}/logs", people[1]["logs-b"])
    follower.run()
    assert follower.status == 404 and follower.events == []


def test_with_redis_away_a_follower_reads_the_table_and_loses_nothing(people, running):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    server, url = start_control_plane(env={"REDIS_URL": dead, "HETEROFLOW_LOG_FOLLOW_POLL_SECONDS": "0.5"})
    try:
        ship(url, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("first")}])
        follower = Follower(f"{url}/api/v1/tasks/{running.pk}/logs", people[1]["logs-a"])
        follower.start()
        assert follower.wait_for(1) == ["first"]
        ship(url, "log-node", [{"task_id": running.pk, "run": "r", "lines": lines("x", "y", start=1)}])
        assert follower.wait_for(3) == ["first", "x", "y"]
        finish(running)
        follower.join(10)
        assert follower.events[-1][0] == "end"
    finally:
        stop_process(server)


def test_a_groups_log_carries_each_ranks_lines_and_ends_with_the_group(agent, reader, plane, people):
    tenant = people[0][0]
    node = make_node("log-group-node", gpus=2)
    group = make_group(tenant, 2, 1, members={"status": TaskStatus.RUNNING, "node": node})
    members = list(group.tasks.order_by("rank"))
    agent.ship(
        "log-group-node",
        [
            {"task_id": members[0].pk, "run": "r", "lines": lines("rank0 step1", "rank0 step2")},
            {"task_id": members[1].pk, "run": "r", "lines": lines("rank1 step1")},
        ],
    )
    key = people[1]["logs-a"]
    page = reader.get(f"/api/v1/task-groups/{group.pk}/logs", key).json()
    assert sorted((line["rank"], line["text"]) for line in page["lines"]) == [
        (0, "rank0 step1"),
        (0, "rank0 step2"),
        (1, "rank1 step1"),
    ]
    assert page["next"] == "0:2,1:1"
    only = reader.get(f"/api/v1/task-groups/{group.pk}/logs", key, rank=1).json()
    assert [line["text"] for line in only["lines"]] == ["rank1 step1"]
    for member in members:
        services.move_tasks(member.pk, [TaskStatus.RUNNING], TaskStatus.COMPLETED, exit_code=0)
    follower = Follower(f"{plane}/api/v1/task-groups/{group.pk}/logs", key, {"Last-Event-ID": "0:1,1:1"})
    follower.run()
    assert follower.texts() == ["rank0 step2"]
    assert follower.events[-1] == ("end", None, {"status": "completed", "exit_codes": {"0": 0, "1": 0}})
    assert reader.get(f"/api/v1/task-groups/{group.pk}/logs", people[1]["logs-b"]).status_code == 404
    Task.objects.filter(node=node).delete()
    node.delete()
