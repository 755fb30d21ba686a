"""The inference services' API: a strict body whose every refusal writes nothing (the
model must be one of the tenant's, the policies are checked by their own modules), the
deploy through apps.inference.services, the detail with its replicas (node, port, health,
address), the window and the decisions, the actions (scale, stop, wake) and their
refusals, paging, another tenant's service answering 404 everywhere, the schema."""

import json
from datetime import UTC, datetime

import pytest

from apps.inference.api.serializers import window_status
from apps.inference.models import InferenceService, ServiceDecision
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task, TaskGroup
from apps.tenants.models import Tenant
from tests.factories import make_node
from tests.headers import bearer
from tests.inference.service_rows import decide, make_model, make_service

pytestmark = pytest.mark.django_db

URL = "/api/v1/inference-services"
BODY = {
    "name": "chat",
    "model": "qwen3-8b",
    "gpu_type": "nvidia",
    "min_replicas": 1,
    "max_replicas": 3,
}


def written():
    return (
        InferenceService.objects.count(),
        TaskGroup.objects.count(),
        Task.objects.count(),
        ServiceDecision.objects.count(),
    )


def post(api, key, body, url=URL):
    return api.post(url, body, format="json", **bearer(key))


@pytest.fixture
def models(world):
    return {
        "acme": make_model(world.tenants["acme"], "qwen3-8b", engines=["vllm", "sglang"]),
        "beta": make_model(world.tenants["beta"], "beta-only"),
    }


WINDOW = {"days": ["mon"], "ranges": [{"start": "09:00", "end": "18:00"}], "timezone": "UTC", "action": "pause"}


@pytest.mark.parametrize(
    "change,field,words",
    [
        ({"surprise": 1}, "surprise", "Unknown field."),
        ({"model": "nope"}, "model", "Tenant 'acme' has no model named 'nope' (register it first)."),
        ({"model": "beta-only"}, "model", "Tenant 'acme' has no model named 'beta-only'"),
        ({"model": "has space"}, "model", "Not a model name"),
        ({"engine": "tensorflow"}, "engine", '"tensorflow" is not an engine: auto or one of vllm'),
        ({"engine": "llama.cpp"}, "engine", "Model 'qwen3-8b' lists the engines vllm, sglang, not llama.cpp"),
        ({"gpu_type": "tpu"}, "gpu_type", '"tpu" is not a known GPU vendor'),
        ({"gpus_per_replica": -1}, "gpus_per_replica", "greater than or equal to 0"),
        ({"gpus_per_replica": 0}, "gpu_memory_mb", "Required with gpus_per_replica 0"),
        ({"min_replicas": 0}, "min_replicas", "greater than or equal to 1"),
        ({"min_replicas": 4}, "max_replicas", "max_replicas (3) is below min_replicas (4)."),
        ({"max_replicas": 5000}, "max_replicas", "less than or equal to 1024"),
        ({"autoscaling": {"target_in_flight": 0}}, "autoscaling", "Target_in_flight must be above 0."),
        ({"autoscaling": {"oops": 1}}, "autoscaling", "Unknown fields: oops."),
        ({"autoscaling": {"min_replicas": 2}}, "autoscaling", "min_replicas is a field of the service"),
        (
            {"autoscaling": {"target_in_flight": None}},
            "autoscaling",
            "Set at least one target: target_in_flight, target_tokens_per_s or target_gpu_utilisation.",
        ),
        ({"autoscaling": [1]}, "autoscaling", 'Expected a dictionary of items but got type "list".'),
        ({"window": WINDOW | {"timezone": "Mars/Olympus"}}, "window", "Unknown time zone 'Mars/Olympus'"),
        ({"window": WINDOW | {"ranges": [{"start": "09:00", "end": "09:00"}]}}, "window", "starts and ends at"),
        ({"window": WINDOW | {"action": "scale", "scale_to": 4}}, "window", "scale_to (4) is above max_replicas (3)."),
        ({"sleep_after_seconds": 30}, "sleep_after_seconds", "Sleep_after_seconds must be at least 60"),
        ({"health_probe": {"path": "v1/models"}}, "health_probe", "A path starts with /."),
        ({"health_probe": {"type": "grpc"}}, "health_probe", "not a valid choice"),
        ({"env": {"1BAD": "x"}}, "env", "'1BAD' is not a valid variable name"),
        ({"engine_args": "--ctx 4096"}, "engine_args", 'Expected a list of items but got type "str".'),
        ({"priority": 101}, "priority", "less than or equal to 100"),
        ({"name": ""}, "name", "may not be blank"),
        ({"runtime": "vm"}, "runtime", "not a valid choice"),
        ({"affinity": {"nodes": {"a": "b"}}}, "affinity", "Unknown field."),
        (
            {"affinity": {"nodes_with_labels": {"pool": "a"}}, "anti_affinity": {"labels": {"pool": "a"}}},
            "anti_affinity",
            "Asked for and avoided at once, so no node could take it: pool=a.",
        ),
    ],
)
def test_a_bad_body_is_400_naming_the_field_and_writes_nothing(api, world, models, change, field, words):
    before = written()
    response = post(api, world.keys["acme-member"], BODY | change)
    assert response.status_code == 400, response.content
    fields = response.json()["error"]["fields"]
    assert field in fields, fields
    assert words in json.dumps(fields[field], ensure_ascii=False).replace('\\"', '"'), fields[field]
    assert written() == before


def test_every_problem_is_named_at_once(api, world, models):
    body = BODY | {"gpu_type": "tpu", "sleep_after_seconds": 5, "window": {"days": []}, "extra": True}
    fields = post(api, world.keys["acme-member"], body).json()["error"]["fields"]
    assert set(fields) == {"gpu_type", "sleep_after_seconds", "window", "extra"}


def test_an_operator_names_the_tenant_whose_model_it_is(api, world, models):
    response = post(api, world.operator_key, BODY)
    assert response.status_code == 400 and "tenant" in response.json()["error"]["fields"]
    response = post(api, world.operator_key, BODY | {"tenant": "beta"})  # beta has no qwen3-8b
    assert response.json()["error"]["fields"] == {
        "model": ["Tenant 'beta' has no model named 'qwen3-8b' (register it first)."]
    }
    assert post(api, world.operator_key, BODY | {"tenant": "nope"}).status_code == 404
    assert post(api, world.keys["acme-member"], BODY | {"tenant": "beta", "model": "beta-only"}).status_code == 404


# --- deploying ------------------------------------------------------------------------------


def test_a_member_deploys_a_service_and_reads_it_back(api, world, models):
    body = BODY | {
        "engine": "vllm",
        "gpus_per_replica": 2,
        "gpu_memory_mb": 40_000,
        "min_replicas": 2,
        "max_replicas": 4,
        "engine_args": ["--max-model-len", "8192"],
        "autoscaling": {"target_in_flight": 4, "scale_down_cooldown_s": 600},
        "window": WINDOW,
        "sleep_after_seconds": 900,
        "env": {"HF_HUB_OFFLINE": "1"},
        "labels": {"zone": "az1"},
        "priority": 70,
    }
    response = post(api, world.keys["acme-member"], body)
    assert response.status_code == 201, response.content
    answer = response.json()
    service = InferenceService.objects.select_related("group", "model").get(pk=answer["id"])
    assert (service.model, service.engine, service.min_replicas, service.max_replicas, service.replicas) == (
        models["acme"],
        "vllm",
        2,
        4,
        2,
    )
    assert service.group.tenant == world.tenants["acme"] and service.group.kind == "inference"
    assert service.group.placement == "replicas" and service.group.gpus_per_worker == 2
    assert service.autoscaling == {"target_in_flight": 4, "scale_down_cooldown_s": 600}
    assert service.window == WINDOW and service.sleep_after_seconds == 900
    assert answer["tenant"] == "acme" and answer["model"] == "qwen3-8b" and answer["gpus_per_replica"] == 2
    assert [m["rank"] for m in answer["members"]] == [0, 1]
    assert {m["status"] for m in answer["members"]} == {"pending"}
    assert {m["healthy"] for m in answer["members"]} == {False} and answer["healthy_replicas"] == 0
    assert answer["window_status"]["holds"] is False and "inside" in answer["window_status"]
    assert answer["decisions"][0]["source"] == "user" and answer["decisions"][0]["action"] == "create"
    detail = api.get(f"{URL}/{service.pk}", **bearer(world.keys["acme-viewer"]))
    assert detail.status_code == 200 and detail.json()["members"] == answer["members"]


def test_defaults_max_is_min_and_the_router_chooses(api, world, models):
    response = post(api, world.keys["acme-member"], {"name": "c", "model": "qwen3-8b", "gpu_type": "nvidia"})
    assert response.status_code == 201, response.content
    answer = response.json()
    assert (answer["engine"], answer["image"], answer["min_replicas"], answer["max_replicas"], answer["replicas"]) == (
        "auto",
        "auto",
        1,
        1,
        1,
    )
    assert answer["window"] is None and answer["window_status"] is None and answer["sleep_after_seconds"] is None


def test_a_service_over_the_quota_is_refused_whole(api, world, models):
    Tenant.objects.filter(pk=world.tenants["acme"].pk).update(max_gpus=3)
    before = written()
    response = post(api, world.keys["acme-member"], BODY | {"min_replicas": 2, "gpus_per_replica": 2})
    assert response.status_code == 409 and response.json()["error"]["code"] == "quota_exceeded"
    assert written() == before


def test_viewers_cannot_deploy_and_nothing_is_written(api, world, models):
    before = written()
    assert post(api, world.keys["acme-viewer"], BODY).status_code == 403
    assert written() == before


def test_an_operator_deploys_for_the_tenant_it_names(api, world, models):
    response = post(api, world.operator_key, BODY | {"tenant": "beta", "model": "beta-only"})
    assert response.status_code == 201, response.content
    assert InferenceService.objects.get(pk=response.json()["id"]).group.tenant == world.tenants["beta"]


# --- reading --------------------------------------------------------------------------------


def test_the_list_is_scoped_paged_and_filtered(api, world, models):
    ours = make_service(world.tenants["acme"], models["acme"], name="a")
    stopped = make_service(world.tenants["acme"], models["acme"], name="b", replicas=0, state="stopped")
    theirs = make_service(world.tenants["beta"], models["beta"], name="c")
    key = bearer(world.keys["acme-viewer"])
    body = api.get(URL, **key).json()
    assert body["count"] == 2 and [s["id"] for s in body["results"]] == [stopped.pk, ours.pk]
    assert [s["id"] for s in api.get(f"{URL}?state=stopped", **key).json()["results"]] == [stopped.pk]
    assert api.get(f"{URL}?model=nope", **key).json()["count"] == 0
    assert api.get(f"{URL}?limit=1", **key).json()["next"]
    assert api.get(f"{URL}?state=bogus", **key).status_code == 400
    assert api.get(f"{URL}?color=red", **key).status_code == 400
    assert theirs.pk in [s["id"] for s in api.get(URL, **bearer(world.operator_key)).json()["results"]]


@pytest.mark.parametrize(
    "method,suffix", [("get", ""), ("post", "/scale"), ("post", "/stop"), ("post", "/wake"), ("get", "/decisions")]
)
def test_another_tenants_service_is_404_everywhere(api, world, models, method, suffix):
    theirs = make_service(world.tenants["beta"], models["beta"])
    key = bearer(world.keys["acme-admin"])
    before = written()
    for pk in (theirs.pk, 999_999):
        url = f"{URL}/{pk}{suffix}"
        response = api.post(url, {"replicas": 1}, format="json", **key) if method == "post" else api.get(url, **key)
        assert response.status_code == 404 and response.json()["error"] == {
            "code": "not_found",
            "message": "Not found.",
            "fields": {},
        }
    assert written() == before


def test_the_detail_shows_each_replica_where_it_runs_and_whether_it_answers(api, world, models):
    node = make_node("gpu-01", 4, ip="10.0.0.5")
    service = make_service(
        world.tenants["acme"], models["acme"], replicas=2, status="running", node=node, state="running"
    )
    first, second = service.group.tasks.order_by("rank")
    node.task_health = [{"task_id": first.pk, "healthy": True}, {"task_id": second.pk, "healthy": False}]
    node.save(update_fields=["task_health"])
    answer = api.get(f"{URL}/{service.pk}", **bearer(world.keys["acme-viewer"])).json()
    rows = {m["rank"]: m for m in answer["members"]}
    assert (rows[0]["node_id"], rows[0]["host_port"], rows[0]["healthy"], rows[0]["address"]) == (
        "gpu-01",
        8000,
        True,
        "http://10.0.0.5:8000",
    )
    assert rows[1]["healthy"] is False and rows[1]["status"] == "running"
    assert answer["healthy_replicas"] == 1


def test_decisions_are_newest_first_paged_and_filtered(api, world, models):
    service = make_service(world.tenants["acme"], models["acme"])
    for number in range(25):
        decide(service, reason=f"r{number}", source="autoscaler" if number % 2 else "window")
    key = bearer(world.keys["acme-viewer"])
    detail = api.get(f"{URL}/{service.pk}", **key).json()
    assert len(detail["decisions"]) == 20 and detail["decisions"][0]["reason"] == "r24"
    page = api.get(f"{URL}/{service.pk}/decisions?limit=10&offset=20", **key).json()
    assert page["count"] == 25 and [d["reason"] for d in page["results"]] == ["r4", "r3", "r2", "r1", "r0"]
    only = api.get(f"{URL}/{service.pk}/decisions?source=autoscaler", **key).json()
    assert only["count"] == 12 and {d["source"] for d in only["results"]} == {"autoscaler"}
    assert api.get(f"{URL}/{service.pk}/decisions?source=nobody", **key).status_code == 400


def test_the_window_status_says_whether_it_holds(api, world, models):
    always = {
        "days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"],
        "ranges": [{"start": "00:00", "end": "24:00"}],
        "timezone": "UTC",
        "action": "pause",
    }
    service = make_service(world.tenants["acme"], models["acme"], window=always)
    status = api.get(f"{URL}/{service.pk}", **bearer(world.keys["acme-viewer"])).json()["window_status"]
    assert status == {"inside": True, "next_boundary": None, "holds": False, "action": "", "remembered": None}
    InferenceService.objects.filter(pk=service.pk).update(window_action="pause", window_remembered=2, replicas=0)
    status = api.get(f"{URL}/{service.pk}", **bearer(world.keys["acme-viewer"])).json()["window_status"]
    assert status["holds"] is True and status["action"] == "pause" and status["remembered"] == 2


# --- actions ------------------------------------------------------------------------------


def test_a_member_scales_within_the_bounds(api, world, models):
    service = make_service(world.tenants["acme"], models["acme"], replicas=1, max_replicas=3, state="running")
    key = world.keys["acme-member"]
    for wanted in (0, 4):
        response = post(api, key, {"replicas": wanted}, f"{URL}/{service.pk}/scale")
        assert (
            response.status_code == 400 and "Between min_replicas (1) and max_replicas (3)" in response.content.decode()
        )
    assert post(api, key, {"replicas": 2, "extra": 1}, f"{URL}/{service.pk}/scale").status_code == 400
    assert post(api, world.keys["acme-viewer"], {"replicas": 2}, f"{URL}/{service.pk}/scale").status_code == 403
    response = post(api, key, {"replicas": 3}, f"{URL}/{service.pk}/scale")
    assert response.status_code == 200, response.content
    answer = response.json()
    assert answer["replicas"] == 3 and [m["rank"] for m in answer["members"] if m["status"] == "pending"][-1] == 2
    latest = answer["decisions"][0]
    assert (latest["source"], latest["from_replicas"], latest["to_replicas"]) == ("user", 1, 3)
    assert "acme-member" in latest["reason"]
    # the same count again: nothing to do, no decision
    again = post(api, key, {"replicas": 3}, f"{URL}/{service.pk}/scale")
    assert again.status_code == 200 and again.json()["decisions"][0]["id"] == latest["id"]


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"state": "stopped"}, "it is stopped"),
        ({"state": "stopping"}, "it is stopping"),
        ({"state": "paused"}, "its scheduling window has paused it"),
        ({"state": "running", "window_action": "scale", "window_remembered": 2}, "a scheduling window holds"),
    ],
)
def test_a_scale_the_state_does_not_allow_is_409(api, world, models, fields, words):
    service = make_service(world.tenants["acme"], models["acme"], replicas=1, max_replicas=3, **fields)
    before = written()
    response = post(api, world.keys["acme-member"], {"replicas": 2}, f"{URL}/{service.pk}/scale")
    assert response.status_code == 409 and words in response.json()["error"]["message"]
    assert written() == before


def test_stop_is_one_way_and_asking_again_while_it_stops_is_not_an_error(api, world, models):
    service = make_service(world.tenants["acme"], models["acme"], replicas=2, state="starting")
    url = f"{URL}/{service.pk}/stop"
    assert post(api, world.keys["acme-viewer"], {}, url).status_code == 403
    response = post(api, world.keys["acme-member"], {}, url)
    assert response.status_code == 200, response.content
    assert response.json()["state"] in ("stopping", "stopped")
    assert {t.status for t in service.group.tasks.all()} <= {"cancelled", "stopping", "stopped"}
    again = post(api, world.keys["acme-member"], {}, url)
    assert again.status_code == 200 and again.json()["state"] == "stopping"
    InferenceService.objects.filter(pk=service.pk).update(state="stopped")
    assert post(api, world.keys["acme-member"], {}, url).status_code == 409
    assert post(api, world.keys["acme-member"], {}, f"{URL}/{service.pk}/wake").status_code == 409


def test_wake_wakes_a_sleeping_service_and_is_a_no_op_when_awake(api, world, models):
    awake = make_service(world.tenants["acme"], models["acme"], name="awake", state="running")
    before = written()
    response = post(api, world.keys["acme-member"], {}, f"{URL}/{awake.pk}/wake")
    assert response.status_code == 200 and response.json()["state"] == "running"
    assert written() == before
    asleep = make_service(
        world.tenants["acme"],
        models["acme"],
        name="asleep",
        status="sleeping",
        state="sleeping",
        node=make_node("n1", 2),
    )
    response = post(api, world.keys["acme-member"], {}, f"{URL}/{asleep.pk}/wake")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "waking"
    paused = make_service(world.tenants["acme"], models["acme"], name="paused", state="paused")
    assert post(api, world.keys["acme-member"], {}, f"{URL}/{paused.pk}/wake").status_code == 409


def test_the_schema_documents_the_endpoints(api, world):
    schema = api.get("/api/schema/?format=json", **bearer(world.operator_key)).json()
    paths = schema["paths"]
    for path in (
        URL,
        f"{URL}/{{id}}",
        f"{URL}/{{id}}/scale",
        f"{URL}/{{id}}/stop",
        f"{URL}/{{id}}/wake",
        f"{URL}/{{id}}/decisions",
    ):
        assert path in paths, sorted(p for p in paths if "inference" in p)
    create = schema["components"]["schemas"]["ServiceCreateRequest"]
    assert {"model", "engine", "min_replicas", "max_replicas", "autoscaling", "window", "sleep_after_seconds"} <= set(
        create["properties"]
    )
    assert "members" in schema["components"]["schemas"]["ServiceDetail"]["properties"]


def test_window_status_is_read_at_the_time_given(world, models):
    service = make_service(world.tenants["acme"], models["acme"], window=WINDOW)  # Mondays 09:00–18:00 UTC
    monday_ten = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    assert window_status(service, monday_ten)["inside"] is True
    assert window_status(service, monday_ten)["next_boundary"] == datetime(2026, 11, 30, 18, 0, tzinfo=UTC)
    assert window_status(service, datetime(2026, 12, 1, 10, 0, tzinfo=UTC))["inside"] is False
    service.window = None
    assert window_status(service, monday_ten) is None


def test_a_sleeping_service_takes_a_new_count_and_its_wake_starts_that_many(api, world, models):
    node = make_node("n1", 4)
    service = make_service(
        world.tenants["acme"], models["acme"], replicas=1, max_replicas=3, status="stopped", node=node, state="sleeping"
    )
    key = world.keys["acme-member"]
    answer = post(api, key, {"replicas": 2}, f"{URL}/{service.pk}/scale").json()
    assert answer["replicas"] == 2 and answer["state"] == "sleeping"
    assert [m["status"] for m in answer["members"]] == ["stopped"]  # nothing started while it sleeps
    answer = post(api, key, {}, f"{URL}/{service.pk}/wake").json()
    assert answer["state"] == "waking" and [m["status"] for m in answer["members"]] == ["pending", "pending"]


def test_deployed_replicas_are_placed_by_a_real_cycle_and_listed_where_they_run(api, world, models):
    make_node("gpu-01", 4, ip="10.0.0.5")
    make_node("gpu-02", 4, ip="10.0.0.6")
    answer = post(api, world.keys["acme-member"], BODY | {"min_replicas": 2, "gpus_per_replica": 2}).json()
    run_cycle()
    members = api.get(f"{URL}/{answer['id']}", **bearer(world.keys["acme-viewer"])).json()["members"]
    assert [m["status"] for m in members] == ["scheduled", "scheduled"]
    ips = {"gpu-01": "10.0.0.5", "gpu-02": "10.0.0.6"}
    for member in members:
        assert 8000 <= member["host_port"] < 9000 and member["node_address"] == ips[member["node_id"]]
        assert member["address"] == f"http://{ips[member['node_id']]}:{member['host_port']}"
        assert member["healthy"] is False  # not running yet


def test_viewers_only_look_and_operators_act_on_any_tenants_service(api, world, models):
    service = make_service(world.tenants["beta"], models["beta"], replicas=1, max_replicas=2, state="sleeping")
    before = written()
    for action in ("scale", "stop", "wake"):
        response = post(api, world.keys["beta-viewer"], {"replicas": 2}, f"{URL}/{service.pk}/{action}")
        assert response.status_code == 403, (action, response.content)
    assert written() == before
    response = post(api, world.operator_key, {"replicas": 2}, f"{URL}/{service.pk}/scale")
    assert response.status_code == 200 and response.json()["replicas"] == 2
    assert response.json()["decisions"][0]["reason"] == "scaled by op from 1 to 2"


def test_the_list_and_the_detail_take_a_fixed_number_of_queries(api, world, models, django_assert_max_num_queries):
    key = bearer(world.keys["acme-viewer"])
    make_service(world.tenants["acme"], models["acme"], name="s0")
    api.get(URL, **key)  # warm the authentication's caches
    with django_assert_max_num_queries(12) as few:
        api.get(URL, **key)
    for number in range(1, 6):
        service = make_service(world.tenants["acme"], models["acme"], name=f"s{number}", replicas=3)
        decide(service)
    with django_assert_max_num_queries(len(few.captured_queries)):
        assert api.get(URL, **key).json()["count"] == 6
    api.get(f"{URL}/{service.pk}", **key)
    with django_assert_max_num_queries(14) as one:
        api.get(f"{URL}/{service.pk}", **key)
    for _ in range(20):
        decide(service)
    with django_assert_max_num_queries(len(one.captured_queries)):
        assert len(api.get(f"{URL}/{service.pk}", **key).json()["decisions"]) == 20


def test_the_replicas_take_the_services_hard_constraints(api, world, models):
    body = BODY | {
        "min_replicas": 2,
        "runtime": "container",
        "affinity": {"nodes_with_labels": {"pool": "serving"}},
        "anti_affinity": {"same_service": True, "labels": {"maintenance": "yes"}},
    }
    response = post(api, world.keys["acme-member"], body)
    assert response.status_code == 201, response.content
    service = response.json()
    assert (service["runtime"], service["affinity"], service["anti_affinity"]) == (
        "container",
        {"nodes_with_labels": {"pool": "serving"}},
        {"same_service": True, "labels": {"maintenance": "yes"}},
    )
    replicas = Task.objects.filter(group_id=service["id"])
    assert replicas.count() == 2
    assert [(t.runtime, t.affinity, t.anti_affinity) for t in replicas] == [
        ("container", body["affinity"], body["anti_affinity"])
    ] * 2
