"""Heartbeat ingestion through the real ASGI route and a real PostgreSQL. The data is
committed (the route has its own connection pool), hence transactional tests."""

import asyncio
from datetime import timedelta

import psycopg
import pytest
import time_machine

from apps.core.clock import utcnow
from apps.nodes import heartbeat
from apps.nodes.models import Gpu, Node
from tests.headers import AGENT_HTTP
from tests.nodes.agents import Agents
from tests.nodes.payloads import gpu_stat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)


def metric_rows(node_id):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM node_metrics WHERE node_id = %s", [node_id])
        return cursor.fetchone()[0]


def test_first_heartbeat_registers_the_node_with_its_gpus(agents):
    response = agents.send("node-a", payload(), peer="198.51.100.7")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["registered"] is True and body["status"] == "online" and body["scheduled_tasks"] == []
    node = Node.objects.get(pk="node-a")
    assert node.name == "agent-node-a"
    assert node.ip == "198.51.100.7"
    assert node.mac == "3c:ec:ef:12:34:56" and node.internal_ip == "10.20.30.40"
    assert (node.gpu_count, node.gpu_type, node.gpu_model) == (8, "nvidia", "NVIDIA H100 80GB HBM3")
    assert node.agent_version == "2.4.1" and node.labels["heteroflow.network_zone"] == "vpc-0a1b2c3d"
    gpus = list(node.gpus.order_by("index"))
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[3].utilization == 40.0 and gpus[3].power_w == 313.5
    assert metric_rows("node-a") == 1
    assert agents.send("node-a", payload()).json()["registered"] is False


def test_public_ip_is_the_tcp_source_never_a_forwarded_header(agents):
    agents.send(
        "node-b",
        payload(),
        peer="198.51.100.8",
        headers=AGENT_HTTP | {"X-Forwarded-For": "1.2.3.4", "X-Real-IP": "1.2.3.4"},
    )
    assert Node.objects.get(pk="node-b").ip == "198.51.100.8"
    agents.send("node-b", payload(), peer="198.51.100.9")
    assert Node.objects.get(pk="node-b").ip == "198.51.100.9"  # refreshed on every beat


def test_forwarded_header_counts_only_behind_a_trusted_proxy(settings):
    settings.HETEROFLOW_TRUSTED_PROXIES = ["10.0.0.0/8"]
    agents = Agents()
    try:
        agents.send(
            "node-c",
            payload(),
            peer="10.1.2.3",
            headers=AGENT_HTTP | {"X-Forwarded-For": "9.9.9.9, 203.0.113.50, 10.9.9.9"},
        )
        assert Node.objects.get(pk="node-c").ip == "203.0.113.50"
        agents.send("node-c", payload(), peer="192.0.2.1", headers=AGENT_HTTP | {"X-Forwarded-For": "203.0.113.99"})
        assert Node.objects.get(pk="node-c").ip == "192.0.2.1"
    finally:
        agents.close()


class StatementCounter:
    def __init__(self, monkeypatch):
        self.statements = []
        original = psycopg.AsyncCursor.execute

        async def counting(cursor, query, params=None, **kwargs):
            self.statements.append(str(query).split()[0].upper())
            return await original(cursor, query, params, **kwargs)

        monkeypatch.setattr(psycopg.AsyncCursor, "execute", counting)


def test_a_steady_beat_is_one_statement_and_touches_only_heartbeat_columns(agents, monkeypatch):
    agents.send("node-e", payload())
    Node.objects.filter(pk="node-e").update(name="renamed-by-operator", region="eu-west")
    counter = StatementCounter(monkeypatch)
    response = agents.send("node-e", payload(cpu_used=77.0))
    assert response.status_code == 200
    assert counter.statements == ["WITH"]  # node UPDATE + GPU UPDATE + metrics INSERT, one round trip
    assert metric_rows("node-e") == 2
    assert Gpu.objects.get(node_id="node-e", index=0).present_streak == 2
    node = Node.objects.get(pk="node-e")
    assert node.cpu_used == 77.0
    assert (node.name, node.region) == ("renamed-by-operator", "eu-west")


def test_a_structural_change_takes_the_slow_path_once(agents, monkeypatch):
    agents.send("node-f", payload())
    counter = StatementCounter(monkeypatch)
    agents.send("node-f", payload(agent_version="2.5.0", labels={"rack-power": "a"}))
    assert len(counter.statements) > 1
    node = Node.objects.get(pk="node-f")
    assert node.agent_version == "2.5.0"
    assert node.labels == {
        "heteroflow.network_zone": "vpc-0a1b2c3d",
        "topology": "nvlink",
        "rack-power": "a",
    }  # merged by key
    counter.statements.clear()
    agents.send("node-f", payload(agent_version="2.5.0", labels={"rack-power": "a"}))
    assert counter.statements == ["WITH"]


def test_unread_metrics_are_stored_as_unknown_never_zero(agents):
    stats = [gpu_stat(0, metrics_available=["utilization"], temperature=0.0), gpu_stat(1)]
    del stats[1]["power_w"]
    del stats[1]["metrics_available"]
    agents.send("node-g", payload(gpus=0, gpu_stats=stats, gpu_capabilities={}))
    first, second = Gpu.objects.filter(node_id="node-g").order_by("index")
    assert first.utilization == 37.0 and first.temperature is None and first.power_w is None
    assert first.metrics_available == ["utilization"]
    assert second.power_w is None and second.temperature == 56.0
    assert "power_w" not in second.metrics_available


def test_a_failure_to_read_the_node_answers_503_and_writes_nothing(agents, monkeypatch):
    # the beat finds no matching row, then reading the node fails: never register
    monkeypatch.setattr(heartbeat, "NODE_FOR_UPDATE", "SELECT ip FROM no_such_table WHERE %(id)s IS NOT NULL")
    response = agents.send("node-h", payload())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"
    assert not Node.objects.filter(pk="node-h").exists()
    assert metric_rows("node-h") == 0


def test_a_failure_after_the_read_rolls_back_the_whole_beat(agents, monkeypatch):
    agents.send("node-i", payload(cpu_used=10.0))
    monkeypatch.setattr(heartbeat, "GPU_UPSERT", "INSERT INTO no_such_table VALUES (%(id)s)")
    assert agents.send("node-i", payload(cpu_used=99.0, agent_version="3.0.0")).status_code == 503
    node = Node.objects.get(pk="node-i")
    assert (node.cpu_used, node.agent_version) == (10.0, "2.4.1")
    assert metric_rows("node-i") == 1


def test_an_unreachable_database_answers_503(agents, monkeypatch):
    from apps.core import db

    monkeypatch.setattr(
        db, "libpq_params", lambda **kw: {"host": "127.0.0.1", "port": "1", "dbname": "x", "connect_timeout": 2}
    )
    response = agents.send("node-db", payload())
    assert response.status_code == 503


def test_a_node_coming_back_is_online_on_that_beat(agents):
    from apps.nodes.services import refresh_node_statuses

    agents.send("node-j", payload())
    refresh_node_statuses(now=utcnow() + timedelta(minutes=5))
    assert Node.objects.get(pk="node-j").status == "offline"
    with time_machine.travel(utcnow() + timedelta(minutes=5)):
        assert agents.send("node-j", payload(gpus=4)).json()["status"] == "online"
    assert Node.objects.get(pk="node-j").status == "online"


def test_a_node_that_cannot_execute_is_degraded(agents):
    body = agents.send(
        "node-k", payload(executable=False, docker_available=False, error_message="docker: daemon down")
    ).json()
    assert body["status"] == "degraded"
    assert Node.objects.get(pk="node-k").error_message == "docker: daemon down"


# --- the route's own checks ------------------------------------------------------------


def test_without_the_agent_key_nothing_is_written(agents):
    assert agents.send("node-x", payload(), headers={}).status_code == 401
    wrong = agents.send("node-x", payload(), headers={"X-API-Key": "wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "authentication_failed"
    assert agents.send("node-x", payload(), headers={"Authorization": "Bearer sk-admin-x"}).status_code == 403
    assert not Node.objects.filter(pk="node-x").exists()


def test_put_is_the_same_as_post_and_other_methods_are_refused(agents):
    assert agents.send("node-y", payload(), method="PUT").status_code == 200
    assert agents.send("node-y", None, method="GET").status_code == 405


@pytest.mark.parametrize(
    "changes,fields",
    [
        ({"cpu_used": 140}, ["cpu_used"]),
        ({"heartbeat_interval": 4}, ["heartbeat_interval"]),
        ({"heartbeat_interval": 301}, ["heartbeat_interval"]),
        ({"mac": "not-a-mac"}, ["mac"]),
        ({"internal_ip": "10.0.0.999"}, ["internal_ip"]),
        # a field this server does not know is not the error: the known ones are
        ({"colour": "red", "cpu_used": -1}, ["cpu_used"]),
        (
            {"gpu_stats": [{"index": 0, "vendor": "nvidia", "utilization": 250, "bogus": 1}]},
            ["gpu_stats[0].utilization"],
        ),
        ({"gpu_stats": [gpu_stat(0), gpu_stat(0)]}, ["gpu_stats"]),
        ({"labels": {"ok": 5}}, ["labels.ok"]),
    ],
)
def test_a_malformed_payload_is_refused_naming_each_field(agents, changes, fields):
    response = agents.send("node-z", payload(**changes))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert sorted(error["fields"]) == sorted(fields)
    assert not Node.objects.filter(pk="node-z").exists()


def test_bad_json_bad_ids_and_a_mismatched_body_id_are_refused(agents):
    assert (
        agents.send("node-z", content=b"{nope", headers=AGENT_HTTP | {"Content-Type": "application/json"}).json()[
            "error"
        ]["code"]
        == "parse_error"
    )
    assert agents.send("bad id!", payload(), path="/api/v1/nodes/bad%20id!/heartbeat").status_code == 400
    assert agents.send("node-z", payload(node_id="other")).status_code == 400
    assert agents.send("node-z", [1, 2]).status_code == 400


def test_an_oversized_payload_is_413(agents, settings):
    settings.HETEROFLOW_HEARTBEAT_MAX_BYTES = 4096
    response = agents.send("node-big", payload(error_message="x" * 1500, os="y" * 199, hostname="z" * 255, gpus=8))
    assert response.status_code == 413
    assert not Node.objects.filter(pk="node-big").exists()


def test_other_paths_go_to_django(agents):
    response = agents.send("n", None, method="GET", path="/api/v1/nodes")
    assert response.text == "django"


def test_the_heartbeat_gets_the_host_check_and_the_https_redirect(agents, settings):
    settings.ALLOWED_HOSTS = ["hf.example.com"]
    assert agents.send("node-h1", payload()).status_code == 400  # Host: testserver
    assert not Node.objects.filter(pk="node-h1").exists()
    settings.ALLOWED_HOSTS = ["testserver"]
    settings.SECURE_SSL_REDIRECT = True
    response = agents.send("node-h1", payload())
    assert (
        response.status_code == 301
        and response.headers["location"] == "https://testserver/api/v1/nodes/node-h1/heartbeat"
    )
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert agents.send("node-h1", payload(), headers=AGENT_HTTP | {"X-Forwarded-Proto": "https"}).status_code == 200


def test_server_time_is_utc_with_z(agents):
    assert agents.send("node-z1", payload()).json()["server_time"].endswith("Z")


@pytest.mark.parametrize("missing", ["gpu_stats", "hostname", "executable", "agent_version"])
def test_a_beat_must_carry_the_required_facts(agents, missing):
    body = payload()
    del body[missing]
    response = agents.send("node-req", body)
    assert response.status_code == 400
    assert "body" in response.json()["error"]["fields"] and missing in response.json()["error"]["fields"]["body"][0]


def test_an_empty_beat_marks_nothing_lost(agents):
    agents.send("node-empty", payload(gpus=2))
    for _ in range(4):
        assert agents.send("node-empty", {}).status_code == 400
    assert not Gpu.objects.filter(node_id="node-empty", lost_at__isnull=False).exists()


def test_the_answer_lists_the_tasks_scheduled_to_the_node(agents):
    from apps.tasks.models import Task
    from apps.tenants import services

    agents.send("node-t", payload())
    tenant = services.create_tenant(name="Beat Tasks", slug="beat-tasks")
    try:
        low = Task.objects.create(tenant=tenant, name="low", status="scheduled", node_id="node-t", priority=10)
        high = Task.objects.create(tenant=tenant, name="high", status="scheduled", node_id="node-t", priority=90)
        Task.objects.create(tenant=tenant, name="running", status="running", node_id="node-t")
        assert agents.send("node-t", payload()).json()["scheduled_tasks"] == [high.pk, low.pk]
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)


def test_the_beat_statement_is_never_parsed_client_side(agents, monkeypatch):
    """psycopg parses a named statement (%(name)s) on every execution when it is over
    4 KB or has over 50 parameters (it caches only smaller ones); the beat runs 400
    times a second. It is compiled to PostgreSQL's positional form once, at import, and
    sent on a raw cursor: a steady beat parses nothing in the client."""
    from psycopg import _queries

    agents.send("node-raw", payload())
    parsed = []
    for name in ("_query2pg", "_query2pg_nocache"):
        original = getattr(_queries, name)
        monkeypatch.setattr(_queries, name, lambda *a, _f=original, **k: parsed.append(a[0]) or _f(*a, **k))
    assert agents.send("node-raw", payload(cpu_used=50.0)).status_code == 200
    assert parsed == []
    assert Node.objects.get(pk="node-raw").cpu_used == 50.0


def test_the_positional_beat_names_each_parameter_once_and_keeps_literal_percents():
    sql, names = heartbeat.BEAT_SQL, heartbeat.BEAT_PARAMS
    assert len(names) == len(set(names)) and "%(" not in sql
    assert f"${len(names)}" in sql and f"${len(names) + 1}" not in sql
    assert "format('GPU %s of node %s is lost (%s).'" in sql
    assert heartbeat.positional("a = %(x)s AND b = %(y)s OR c = %(x)s LIKE 'z%%'") == (
        "a = $1 AND b = $2 OR c = $1 LIKE 'z%'",
        ("x", "y"),
    )
    with pytest.raises(ValueError):
        heartbeat.positional("a LIKE 'z%'")


def test_a_farewell_beat_takes_the_node_offline_until_it_beats_again(agents):
    from apps.nodes.services import refresh_node_statuses

    assert agents.send("bye-1", payload()).status_code == 200
    farewell = agents.send("bye-1", payload() | {"shutting_down": True})
    assert farewell.status_code == 200 and farewell.json()["status"] == "offline"
    refresh_node_statuses()
    assert Node.objects.get(pk="bye-1").status == "offline"  # the checker agrees: it said goodbye
    assert agents.send("bye-1", payload()).json()["status"] == "online"
    refresh_node_statuses()
    assert Node.objects.get(pk="bye-1").status == "online"


def ignored_count(field):
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("heteroflow_agent_fields_ignored_total", {"channel": "heartbeat", "field": field})
        or 0
    )


def test_a_newer_agents_unknown_fields_are_ignored_counted_and_logged_once(agents, caplog):
    """Version skew: an agent one release ahead sends fields this server does not know.
    The beat is applied (a rolling upgrade must not take the fleet offline), the unknown
    fields are dropped before anything is stored, counted, and logged once per agent
    version and field, not on every beat."""
    stat = {**gpu_stat(0), "fan_speed_rpm": 1200}
    newer = payload(gpu_stats=[stat, gpu_stat(1)], agent_version="9.9.0", power_budget_w=700)
    before = ignored_count("power_budget_w"), ignored_count("gpu_stats[].fan_speed_rpm")
    with caplog.at_level("WARNING", logger="apps.nodes.api.heartbeat"):
        for _ in range(3):
            response = agents.send("node-next", newer)
            assert response.status_code == 200, response.text
    node = Node.objects.get(pk="node-next")
    assert node.status == "online" and node.agent_version == "9.9.0"
    assert "fan_speed_rpm" not in str(list(Gpu.objects.filter(node=node).values())) and "power_budget_w" not in str(
        Node.objects.filter(pk="node-next").values().get()
    )
    assert (ignored_count("power_budget_w"), ignored_count("gpu_stats[].fan_speed_rpm")) == (
        before[0] + 3,
        before[1] + 3,
    )
    skew_lines = [record for record in caplog.records if "does not know" in record.getMessage()]
    assert len(skew_lines) == 1 and "9.9.0" in skew_lines[0].getMessage()
    assert "gpu_stats[].fan_speed_rpm" in skew_lines[0].getMessage()


def test_the_fields_the_server_knows_stay_strict_beside_unknown_ones(agents):
    response = agents.send("node-next", payload(power_budget_w=700, cpu_used=140))
    assert response.status_code == 400
    assert sorted(response.json()["error"]["fields"]) == ["cpu_used"]
    assert not Node.objects.filter(pk="node-next").exists()


def test_the_strict_reading_still_names_unknown_fields():
    """The contract as the agent's own tests hold it (heartbeat_errors: no field the
    schema lacks) is unchanged; only the server reads tolerantly."""
    from apps.nodes.protocol import heartbeat_errors, read_heartbeat

    beat = payload(power_budget_w=700)
    assert heartbeat_errors(beat) == {"power_budget_w": ["Unknown field."]}
    assert read_heartbeat(beat) == ({}, ["power_budget_w"]) and "power_budget_w" not in beat


def test_slice_capabilities_are_accepted_and_kept_and_malformed_ones_refused(agents):
    """The slice fields the agent reports per card (issue 18): the MIG instances of a
    card in MIG mode (a GPU instance without a compute instance has no "ci") and
    whether a Hygon card can be carved into vDCUs."""
    capabilities = {
        "0": {
            "mig_capable": True,
            "mps_capable": False,
            "best_tier": 1,
            "mig_instances": [
                {"uuid": "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", "gi": 1, "ci": 0, "profile": "1g.5gb"},
                {"uuid": "", "gi": 2, "profile": "2g.10gb"},
            ],
        },
        "1": {"mig_capable": False, "mps_capable": False, "best_tier": 2, "hami_capable": True},
    }
    response = agents.send("node-s", payload(gpus=2, gpu_capabilities=capabilities))
    assert response.status_code == 200, response.text
    assert Node.objects.get(pk="node-s").gpu_capabilities == capabilities
    for bad in (
        {"0": {"mig_instances": [{"uuid": "MIG-x", "ci": 0}]}},  # no gi
        {"0": {"mig_instances": [{"gi": 1, "ci": None}]}},  # no nulls
        {"0": {"hami_capable": "yes"}},
    ):
        assert agents.send("node-s", payload(gpus=2, gpu_capabilities=bad)).status_code == 400, bad
    # a key this server does not know (a newer agent's) is dropped, the beat kept; the
    # card key "0" reaches the validator's error path as the number 0
    newer = {"0": {"mig_capable": True, "mig_instances": [{"gi": 1, "slot": 3}]}}
    response = agents.send("node-s", payload(gpus=2, gpu_capabilities=newer))
    assert response.status_code == 200, response.text
    assert Node.objects.get(pk="node-s").gpu_capabilities == {"0": {"mig_capable": True, "mig_instances": [{"gi": 1}]}}


def test_a_connection_the_database_ended_fails_no_beat(agents):
    """The route's pooled connections are checked when taken: after the database ends
    them (a restart, pg_terminate_backend), the next beat still lands."""
    from django.db import connection

    assert agents.send("node-t", payload()).status_code == 200
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cursor.fetchone()[0] >= 1  # the route's pooled connection
    for _ in range(3):
        assert agents.send("node-t", payload()).status_code == 200


def test_the_retention_job_is_asked_for_once_per_period_not_per_beats(agents, monkeypatch):
    from apps.nodes.api import heartbeat as route
    from apps.nodes.metrics import PRUNE_EVERY_SECONDS

    asked = []
    monkeypatch.setattr(route, "enqueue", asked.append)
    clock = [1000.0]
    agents.app.clock = lambda: clock[0]
    agents.app._prune_asked_at = clock[0]
    for _ in range(600):  # more beats than the old every-500 trigger, inside one period
        assert agents.send("node-p", payload()).status_code == 200
    assert asked == []
    clock[0] += PRUNE_EVERY_SECONDS
    assert agents.send("node-p", payload()).status_code == 200
    agents.loop.run_until_complete(asyncio.sleep(0.1))  # the request runs off the event loop
    assert asked == ["nodes.prune_metrics"]
    assert agents.send("node-p", payload()).status_code == 200
    assert asked == ["nodes.prune_metrics"]


def test_every_change_of_a_nodes_agent_goes_to_the_servers_log(agents, caplog):
    caplog.set_level("INFO", logger="apps.nodes.heartbeat")
    agents.send("node-upgrade", payload())  # registration: nothing to compare with
    agents.send("node-upgrade", payload())
    assert "node node-upgrade: agent" not in caplog.text
    agents.send("node-upgrade", payload(agent_version="2.5.0", agent_git_commit="a1b2c3d"))
    agents.send("node-upgrade", payload(agent_version="2.5.0", agent_git_commit="a1b2c3d"))  # the same: said once
    agents.send("node-upgrade", payload(agent_version="2.5.1", agent_git_commit="e4f5a6b-dirty"))
    changes = [record.getMessage() for record in caplog.records if "node node-upgrade: agent" in record.getMessage()]
    assert changes == [
        "node node-upgrade: agent 2.4.1 (9f1c2ab) -> 2.5.0 (a1b2c3d)",
        "node node-upgrade: agent 2.5.0 (a1b2c3d) -> 2.5.1 (e4f5a6b-dirty)"
        " (built from a tree with uncommitted changes)",
    ]
