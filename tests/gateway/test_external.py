"""Operator-declared external backends: where the URL may point (allow-list, never the
control plane, loopback or link-local metadata), and the API (operators declare, tenants
read theirs, another tenant's is 404). Through the route: test_external_route.py."""

import pytest

from apps.gateway.external import normal_base, url_problems
from apps.gateway.models import ExternalBackend
from tests.headers import bearer


def problems(url, allowed=(".example.com", "10.1.0.0/16"), addresses=("93.184.216.34",)):
    return url_problems(url, allowed=allowed, own_hosts=["hf.example.com"], resolve=lambda host, port: list(addresses))


def test_the_allow_list_and_the_addresses_never_allowed():
    assert problems("https://llm.example.com/v1") == []
    assert problems("http://10.1.2.3:8000/v1", addresses=()) == []
    assert "allow-list" in problems("https://llm.other.org/v1")[0]
    assert "allow-list" in problems("http://10.2.0.1/v1")[0]
    assert "control plane" in problems("https://hf.example.com/v1")[0]
    assert "control plane" in problems("http://localhost:3333/v1")[0]
    assert "169.254.169.254" in problems("https://meta.example.com", addresses=("169.254.169.254",))[0]
    assert "127.0.0.1" in problems("https://loop.example.com", addresses=("93.184.216.34", "127.0.0.1"))[0]
    assert "::1" in problems("https://six.example.com", addresses=("::1",))[0]
    assert problems("ftp://llm.example.com")[0].startswith("Use an http(s) URL")
    assert "query" in problems("https://u:p@llm.example.com/v1")[0]
    assert "query" in problems("https://llm.example.com/v1?key=1")[0]
    assert "empty" in problems("https://llm.example.com", allowed=())[0]

    def unresolvable(host, port):
        raise OSError("no such host")

    assert (
        "resolve"
        in url_problems("https://x.example.com", allowed=[".example.com"], own_hosts=[], resolve=unresolvable)[0]
    )


def test_the_base_url():
    assert normal_base("https://h/v1/") == normal_base("https://h/v1") == normal_base("https://h") == "https://h"


URL = "/api/v1/gateway/backends"


@pytest.mark.django_db
def test_operators_declare_tenants_read_theirs(api, world, settings):
    settings.HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED = ["93.184.216.34/32"]
    body = {"tenant": "acme", "model": "gpt-x", "base_url": "http://93.184.216.34/v1", "secret_name": "openai"}
    assert api.post(URL, body, format="json", **bearer(world.keys["acme-admin"])).status_code == 403
    refused = api.post(
        URL, body | {"base_url": "http://169.254.169.254/v1"}, format="json", **bearer(world.operator_key)
    )
    assert refused.status_code == 400 and "base_url" in refused.json()["error"]["fields"]
    assert api.post(URL, body | {"colour": 1}, format="json", **bearer(world.operator_key)).status_code == 400
    assert not ExternalBackend.objects.exists()
    made = api.post(URL, body, format="json", **bearer(world.operator_key))
    assert made.status_code == 201, made.json()
    backend_id = made.json()["id"]
    assert api.get(URL, **bearer(world.keys["acme-viewer"])).json()["count"] == 1
    assert api.get(URL, **bearer(world.keys["beta-admin"])).json()["count"] == 0
    assert api.get(f"{URL}/{backend_id}", **bearer(world.keys["beta-admin"])).status_code == 404
    assert (
        api.patch(f"{URL}/{backend_id}", {"weight": 5}, format="json", **bearer(world.keys["acme-admin"])).status_code
        == 403
    )
    changed = api.patch(f"{URL}/{backend_id}", {"weight": 5}, format="json", **bearer(world.operator_key))
    assert changed.status_code == 200 and changed.json()["weight"] == 5
    assert api.delete(f"{URL}/{backend_id}", **bearer(world.operator_key)).status_code == 204
