import pytest

from apps.scheduler.services import plugin_settings
from tests.headers import bearer

pytestmark = pytest.mark.django_db


def rows(response):
    return {row["name"]: row for row in response.json()}


def test_the_list_is_what_the_scheduler_uses(api, world):
    table = rows(api.get("/api/v1/scheduler/plugins", **bearer(world.operator_key)))
    assert list(table) == [
        "gpu-filter",
        "resource-filter",
        "spread",
        "binpack",
        "topology",
        "rdma",
        "nvlink",
        "replica-spread",
        "model-cache",
        "preempt",
    ]
    assert table["spread"]["enabled"] and not table["binpack"]["enabled"]
    assert table["gpu-filter"]["locked"] and table["resource-filter"]["locked"]
    assert plugin_settings().layout == "spread"


def test_binpack_and_spread_exclude_each_other(api, world):
    headers = bearer(world.operator_key)
    table = rows(api.post("/api/v1/plugins/binpack?action=enable", **headers))
    assert table["binpack"]["enabled"] and not table["spread"]["enabled"]
    assert plugin_settings().layout == "binpack"
    table = rows(api.post("/api/v1/plugins/binpack?action=disable", **headers))
    assert table["spread"]["enabled"] and not table["binpack"]["enabled"]
    assert plugin_settings().layout == "spread"


def test_correctness_plugins_cannot_be_disabled(api, world):
    response = api.post("/api/v1/plugins/resource-filter?action=disable", **bearer(world.operator_key))
    assert response.status_code == 409 and response.json()["error"]["code"] == "plugin_locked"


def test_weights_and_switches_take_effect_in_the_settings(api, world):
    headers = bearer(world.operator_key)
    api.put("/api/v1/plugins/topology", {"weight": 3}, format="json", **headers)
    api.post("/api/v1/plugins/rdma?action=disable", **headers)
    settings = plugin_settings()
    assert settings.weights["topology"] == 3 and "rdma" not in settings.enabled


def test_the_replica_spread_is_on_by_default_and_can_be_turned_off(api, world):
    headers = bearer(world.operator_key)
    assert "replica-spread" in plugin_settings().enabled
    api.put("/api/v1/plugins/replica-spread", {"weight": 2}, format="json", **headers)
    assert plugin_settings().weights["replica-spread"] == 2
    table = rows(api.post("/api/v1/plugins/replica-spread?action=disable", **headers))
    assert not table["replica-spread"]["enabled"] and "replica-spread" not in plugin_settings().enabled


@pytest.mark.parametrize(
    "method,path,body,expected",
    [
        ("post", "/api/v1/plugins/binpack?action=toggle", None, 400),
        ("post", "/api/v1/plugins/warp-drive?action=enable", None, 404),
        ("put", "/api/v1/plugins/topology", {"weight": -1}, 400),
        ("put", "/api/v1/plugins/topology", {"colour": "red"}, 400),
    ],
)
def test_bad_requests(api, world, method, path, body, expected):
    assert getattr(api, method)(path, body, format="json", **bearer(world.operator_key)).status_code == expected


def test_only_operators(api, world):
    assert api.get("/api/v1/scheduler/plugins", **bearer(world.keys["acme-admin"])).status_code == 403
    assert api.post("/api/v1/plugins/binpack?action=enable", **bearer(world.keys["acme-admin"])).status_code == 403


def test_load_thresholds_are_the_resource_filters_extra(api, world):
    response = api.put(
        "/api/v1/plugins/resource-filter",
        {"extra": {"cpu_percent_max": 80, "gpu_temperature_max": 70}},
        format="json",
        **bearer(world.operator_key),
    )
    assert response.status_code == 200
    settings = plugin_settings()
    assert (settings.cpu_percent_max, settings.gpu_temperature_max, settings.memory_percent_max) == (80, 70, 90)


def test_preempt_stage_is_the_preempt_plugins_extra(api, world):
    headers = bearer(world.operator_key)
    table = rows(api.get("/api/v1/scheduler/plugins", **headers))
    assert table["preempt"] == {
        "name": "preempt",
        "kind": "postfilter",
        "enabled": True,
        "locked": False,
        "weight": 0.0,
        "extra": {"preempt_stage": "running"},
    }
    assert plugin_settings().preempt_stage == "running"
    table = rows(
        api.put("/api/v1/plugins/preempt", {"extra": {"preempt_stage": "scheduled"}}, format="json", **headers)
    )
    assert table["preempt"]["extra"] == {"preempt_stage": "scheduled"}
    assert plugin_settings().preempt_stage == "scheduled"
    api.post("/api/v1/plugins/preempt?action=disable", **headers)
    assert plugin_settings().preempt_stage == "disabled"


def test_extra_is_merged_and_a_null_restores_the_default(api, world):
    headers = bearer(world.operator_key)
    api.put("/api/v1/plugins/resource-filter", {"extra": {"cpu_percent_max": 80}}, format="json", **headers)
    api.put("/api/v1/plugins/resource-filter", {"extra": {"gpu_temperature_max": 70}}, format="json", **headers)
    assert (plugin_settings().cpu_percent_max, plugin_settings().gpu_temperature_max) == (80, 70)
    table = rows(
        api.put("/api/v1/plugins/resource-filter", {"extra": {"cpu_percent_max": None}}, format="json", **headers)
    )
    assert table["resource-filter"]["extra"] == {"gpu_temperature_max": 70}
    assert plugin_settings().cpu_percent_max == 90


@pytest.mark.parametrize(
    "name,extra,field",
    [
        ("preempt", {"preempt_stage": "always"}, "preempt_stage"),
        ("preempt", {"stage": "running"}, "stage"),
        ("resource-filter", {"cpu_percent_max": 150}, "cpu_percent_max"),
        ("resource-filter", {"gpu_temperature_max": "hot"}, "gpu_temperature_max"),
        ("topology", {"anything": 1}, "anything"),
    ],
)
def test_bad_extra_is_refused_naming_the_option_and_nothing_is_written(api, world, name, extra, field):
    headers = bearer(world.operator_key)
    before = rows(api.get("/api/v1/scheduler/plugins", **headers))[name]
    response = api.put(f"/api/v1/plugins/{name}", {"extra": extra, "weight": 7}, format="json", **headers)
    assert response.status_code == 400
    assert field in str(response.json()["error"]["fields"])
    assert rows(api.get("/api/v1/scheduler/plugins", **headers))[name] == before
