import pytest

from apps.scheduler.services import plugin_settings
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def rows(response):
    return {row["name"]: row for row in response.json()}


def test_the_list_is_what_the_scheduler_uses(api, world):
    table = rows(api.get("/api/v1/scheduler/plugins", **bearer(world.operator_key)))
    assert list(table) == ["gpu-filter", "resource-filter", "spread", "binpack", "topology", "rdma", "nvlink"]
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
    response = api.put("/api/v1/plugins/resource-filter", {"extra": {"cpu_percent_max": 80, "gpu_temperature_max": 70}}, format="json", **bearer(world.operator_key))
    assert response.status_code == 200
    settings = plugin_settings()
    assert (settings.cpu_percent_max, settings.gpu_temperature_max, settings.memory_percent_max) == (80, 70, 90)
