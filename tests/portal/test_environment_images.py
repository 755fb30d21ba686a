"""The environment page's image part (docs/images.md) with Django's test client: the
operator's page lists, for the live nodes on the page, their watched images and the
image channel's URLs its script checks them with; offline nodes are marked "cannot
check" and get no URL; rendering makes no request; tenants see no image part. The
script's own calls (session and CSRF token, as the browser sends them) are made here
by hand, and the agent's answer is read back the way the page reads it."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from apps.nodes.models import ImageRequest
from tests.headers import AGENT
from tests.nodes.image_support import claim, completed, item, progress, report, seed_default_watched_images
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def defaults():
    seed_default_watched_images()


def images_data(html: str) -> dict:
    found = re.search(r'<script id="environment-images" type="application/json">(.*?)</script>', html, re.S)
    assert found, "no image data on the page"
    return json.loads(found.group(1))


def test_the_operator_page_offers_the_live_nodes_watched_images_and_asks_nothing(client, world, cluster):
    html = page(signed_in(client, world.operator), "/portal/environment/?tab=all")
    data = images_data(html)
    assert data["poll_ms"] == 5000 and data["check_wait_ms"] == 120_000
    assert set(data["nodes"]) == {"shared-1", "shared-2", "shared-3", "beta-1"}
    live = data["nodes"]["shared-1"]
    assert live["checkable"] and live["check_url"] == "/api/v1/nodes/shared-1/images/check"
    assert live["pull_url"] == "/api/v1/nodes/shared-1/images/pull"
    assert "vllm/vllm-openai" in {w["reference"] for w in live["watched"]}
    assert data["nodes"]["shared-3"] == {"checkable": False}  # offline: no URL, so no request
    assert re.search(r'data-images="shared-3" data-state="cannot-check">cannot check', html)
    assert 'data-images="shared-1" data-state="waiting"' in html
    assert 'data-deploy="vllm/vllm-openai"' in html
    assert "portal/environment.js" in html
    assert ImageRequest.objects.count() == 0  # rendering asks nothing; the script does


def test_the_image_part_is_the_operators(client, world, cluster):
    html = page(signed_in(client, world.users["acme-admin"]), "/portal/environment/?tab=all")
    assert "environment-images" not in html and "data-images=" not in html and "<th>Images</th>" not in html


def test_the_scripts_calls_check_deploy_and_follow(world, cluster, api):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(world.operator)
    html = browser.get("/portal/environment/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    data = images_data(html)
    spec = data["nodes"]["shared-2"]
    headers = {"HTTP_X_CSRFTOKEN": token, "HTTP_ACCEPT": "application/json"}
    references = [w["reference"] for w in spec["watched"]]
    # without the token the session's POST is refused, nothing written
    assert (
        browser.post(spec["check_url"], {"references": references}, content_type="application/json").status_code == 403
    )
    assert ImageRequest.objects.count() == 0
    asked = browser.post(spec["check_url"], {"references": references}, content_type="application/json", **headers)
    assert asked.status_code == 202, asked.content
    row = asked.json()
    # the agent answers: the first watched image present, the others not
    report(api, row["id"], claim("shared-2"))
    items = [item(r, present=i == 0, match="repository" if ":" not in r else "exact") for i, r in enumerate(references)]
    report(api, row["id"], completed("shared-2", *items))
    followed = browser.get(data["request_url"] + str(row["id"]), **headers).json()
    assert followed["status"] == "completed"
    assert sum(i["present"] for i in followed["result"]["images"]) == 1  # "1/m present"
    # deploy: a pull followed every 5 s, its progress as the agent reports it
    pull = browser.post(spec["pull_url"], {"reference": references[1]}, content_type="application/json", **headers)
    assert pull.status_code == 202
    report(api, pull.json()["id"], claim("shared-2"))
    report(api, pull.json()["id"], progress("shared-2", 3, 8, "downloading"))
    moving = browser.get(data["request_url"] + str(pull.json()["id"]), **headers).json()
    assert moving["status"] == "processing" and moving["progress"]["layers_done"] == 3
    assert api.get("/api/v1/agent/image-requests?node_id=shared-2&status=processing", **AGENT).json()["results"]
