"""The image channel's operator API (docs/images.md): pull and check requests for a live
node, the refusal of an offline one (nothing written), bad input (400 naming the field,
nothing written), the list and detail, the watched list and its edits, who may do what."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import ImageRequest, WatchedImage
from tests.factories import make_node
from tests.headers import AGENT, bearer
from tests.nodes.image_support import DIGEST, assert_fits, seed_default_watched_images

pytestmark = pytest.mark.django_db

REGISTRY = "127.0.0.1:5000"


@pytest.fixture(autouse=True)
def defaults():
    seed_default_watched_images()


@pytest.fixture
def op(world):
    return bearer(world.operator_key)


@pytest.fixture
def node():
    return make_node("img-1", 2, vendor="nvidia")


def pull(api, op, node_id, body):
    return api.post(f"/api/v1/nodes/{node_id}/images/pull", body, format="json", **op)


def check(api, op, node_id, body):
    return api.post(f"/api/v1/nodes/{node_id}/images/check", body, format="json", **op)


@pytest.mark.parametrize(
    "reference",
    [f"{REGISTRY}/repo/x:1.0", f"{REGISTRY}/repo/x@{DIGEST}", "repo/x", "vllm/vllm-openai:v0.6.3", "ubuntu"],
)
def test_a_pull_of_an_exact_or_bare_reference_is_a_pending_request(api, op, node, reference):
    answer = pull(api, op, node.pk, {"reference": reference})
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert_fits("request", body)
    assert (body["node_id"], body["action"], body["references"], body["status"]) == (
        node.pk,
        "pull",
        [reference],
        "pending",
    )
    assert body["requested_by"].startswith("op")
    row = ImageRequest.objects.get(pk=body["id"])
    assert timedelta(hours=1, minutes=59) < row.deadline - row.created_at <= timedelta(hours=2)


def test_a_second_pull_of_the_same_open_reference_answers_the_first(api, op, node):
    first = pull(api, op, node.pk, {"reference": "repo/x:1.0"}).json()
    again = pull(api, op, node.pk, {"reference": "repo/x:1.0"})
    assert again.status_code == 202 and again.json()["id"] == first["id"]
    assert ImageRequest.objects.count() == 1
    assert pull(api, op, node.pk, {"reference": "repo/x:2.0"}).json()["id"] != first["id"]


def test_a_check_of_up_to_32_references(api, op, node):
    references = [f"{REGISTRY}/repo/x:{i}" for i in range(31)] + ["repo/y"]
    answer = check(api, op, node.pk, {"references": references})
    assert answer.status_code == 202, answer.content
    assert_fits("request", answer.json())
    assert answer.json()["references"] == references and answer.json()["action"] == "check"


@pytest.mark.parametrize("status", ["offline"])
def test_an_offline_node_gets_no_request_and_the_answer_says_so(api, op, status):
    make_node("gone", 1, status=status, last_heartbeat_at=utcnow() - timedelta(hours=1))
    for answer in (
        pull(api, op, "gone", {"reference": "repo/x:1.0"}),
        check(api, op, "gone", {"references": ["repo/x"]}),
    ):
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "node_offline"
        assert "offline" in answer.json()["error"]["message"]
    assert ImageRequest.objects.count() == 0


def test_a_silent_node_the_health_checker_has_not_caught_up_with_is_offline_too(api, op):
    make_node("silent", 1, status="online", last_heartbeat_at=utcnow() - timedelta(minutes=5))
    assert pull(api, op, "silent", {"reference": "repo/x"}).status_code == 409
    assert ImageRequest.objects.count() == 0


@pytest.mark.parametrize(
    "body, field",
    [
        ({"reference": "Repo/X:1"}, "reference"),  # a path component in capitals
        ({"reference": "repo/x:"}, "reference"),
        ({"reference": "repo//x"}, "reference"),
        ({"reference": "repo/x@sha256:short"}, "reference"),
        ({"reference": "repo/x:" + "t" * 129}, "reference"),
        ({"reference": "-repo/x"}, "reference"),
        ({"reference": ""}, "reference"),
        ({"reference": 7}, "reference"),
        ({"reference": "a" * 256}, "reference"),
        ({}, "reference"),
        ({"reference": "repo/x", "force": True}, "force"),
    ],
)
def test_a_bad_pull_is_400_naming_the_field_and_writes_nothing(api, op, node, body, field):
    answer = pull(api, op, node.pk, body)
    assert answer.status_code == 400, answer.content
    assert field in answer.json()["error"]["fields"]
    assert ImageRequest.objects.count() == 0


@pytest.mark.parametrize(
    "body, field",
    [
        ({"references": []}, "references"),
        ({"references": [f"repo/x:{i}" for i in range(33)]}, "references"),
        ({"references": ["repo/x", "NOT A REF"]}, "references"),
        ({"references": "repo/x"}, "references"),
        ({"references": ["repo/x"], "reference": "repo/y"}, "reference"),
    ],
)
def test_a_bad_check_is_400_naming_the_field_and_writes_nothing(api, op, node, body, field):
    answer = check(api, op, node.pk, body)
    assert answer.status_code == 400, answer.content
    assert field in answer.json()["error"]["fields"]
    assert ImageRequest.objects.count() == 0


def test_only_operators_make_and_read_image_requests(api, world, node):
    made = pull(api, bearer(world.operator_key), node.pk, {"reference": "repo/x"}).json()
    for who in (bearer(world.keys["acme-admin"]), bearer(world.keys["acme-viewer"]), AGENT):
        assert pull(api, who, node.pk, {"reference": "repo/y"}).status_code == 403
        assert check(api, who, node.pk, {"references": ["repo/y"]}).status_code == 403
        assert api.get("/api/v1/image-requests", **who).status_code == 403
        assert api.get(f"/api/v1/image-requests/{made['id']}", **who).status_code == 403
    assert ImageRequest.objects.count() == 1
    assert pull(api, bearer(world.operator_key), "no-such-node", {"reference": "repo/x"}).status_code == 404


def test_the_list_filters_by_node_and_status_and_pages(api, op, node):
    other = make_node("img-2", 1)
    for i in range(3):
        pull(api, op, node.pk, {"reference": f"repo/x:{i}"})
    pull(api, op, other.pk, {"reference": "repo/x:0"})
    ImageRequest.objects.filter(references=["repo/x:0"], node=node).update(status="failed")
    everything = api.get("/api/v1/image-requests", **op).json()
    assert everything["count"] == 4
    for row in everything["results"]:
        assert_fits("request", row)
    assert [r["id"] for r in everything["results"]] == sorted((r["id"] for r in everything["results"]), reverse=True)
    assert api.get(f"/api/v1/image-requests?node_id={node.pk}", **op).json()["count"] == 3
    assert api.get(f"/api/v1/image-requests?node_id={node.pk}&status=pending", **op).json()["count"] == 2
    page = api.get("/api/v1/image-requests?limit=1&offset=1", **op).json()
    assert page["count"] == 4 and len(page["results"]) == 1 and page["next"] and page["previous"]
    assert api.get("/api/v1/image-requests?status=lost", **op).status_code == 400
    assert api.get("/api/v1/image-requests?limit=0", **op).status_code == 400
    assert api.get("/api/v1/image-requests?colour=red", **op).status_code == 400


def test_the_detail(api, op, node):
    made = pull(api, op, node.pk, {"reference": "repo/x"}).json()
    answer = api.get(f"/api/v1/image-requests/{made['id']}", **op)
    assert answer.status_code == 200 and answer.json() == made
    assert api.get("/api/v1/image-requests/987654", **op).status_code == 404


def test_the_watched_list_is_the_vendors_and_every_vendors_images(api, op, node):
    ascend = make_node("npu-1", 1, vendor="ascend")
    cpu = make_node("cpu-1", 0)
    watched = api.get(f"/api/v1/nodes/{node.pk}/images/watched", **op)
    assert watched.status_code == 200
    body = watched.json()
    assert_fits("watched", body)
    references = {image["reference"] for image in body["images"]}
    assert body["vendor"] == "nvidia" and "vllm/vllm-openai" in references and "ubuntu:22.04" in references
    assert not any("ascend" in reference or "mindie" in reference for reference in references)
    assert {image["kind"] for image in body["images"]} == {"engine", "base", "training"}
    assert all(image["note"].startswith("default") for image in body["images"])
    npu = {i["reference"] for i in api.get(f"/api/v1/nodes/{ascend.pk}/images/watched", **op).json()["images"]}
    assert any("mindie" in reference for reference in npu) and "vllm/vllm-openai" not in npu
    bare = api.get(f"/api/v1/nodes/{cpu.pk}/images/watched", **op).json()
    assert bare["vendor"] == "" and {i["reference"] for i in bare["images"]} == {"ubuntu:22.04"}
    # the agent reads it as well; people of a tenant do not
    assert api.get(f"/api/v1/nodes/{node.pk}/images/watched", **AGENT).status_code == 200
    assert api.get(f"/api/v1/nodes/{node.pk}/images/watched", **bearer("sk-nope")).status_code == 401


def test_operators_edit_the_watched_list(api, world, op, node):
    before = WatchedImage.objects.count()
    made = api.post(
        "/api/v1/watched-images",
        {"vendor": "nvidia", "reference": f"{REGISTRY}/team/trainer:2.1", "kind": "training", "note": "ours"},
        format="json",
        **op,
    )
    assert made.status_code == 201, made.content
    watched = {i["reference"] for i in api.get(f"/api/v1/nodes/{node.pk}/images/watched", **op).json()["images"]}
    assert f"{REGISTRY}/team/trainer:2.1" in watched
    again = api.post(
        "/api/v1/watched-images",
        {"vendor": "nvidia", "reference": f"{REGISTRY}/team/trainer:2.1", "kind": "training"},
        format="json",
        **op,
    )
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_watched"
    for body, field in (
        ({"vendor": "nvidia", "reference": "Bad Ref", "kind": "engine"}, "reference"),
        ({"vendor": "quantum", "reference": "repo/x", "kind": "engine"}, "vendor"),
        ({"reference": "repo/x", "kind": "toy"}, "kind"),
        ({"reference": "repo/x", "kind": "engine", "colour": "red"}, "colour"),
    ):
        answer = api.post("/api/v1/watched-images", body, format="json", **op)
        assert answer.status_code == 400 and field in answer.json()["error"]["fields"], answer.content
    assert WatchedImage.objects.count() == before + 1
    pk = made.json()["id"]
    changed = api.put(
        f"/api/v1/watched-images/{pk}",
        {"vendor": "nvidia", "reference": f"{REGISTRY}/team/trainer:2.2", "kind": "training"},
        format="json",
        **op,
    )
    assert changed.status_code == 200 and changed.json()["reference"].endswith(":2.2")
    assert api.get("/api/v1/watched-images?limit=500", **op).json()["count"] == before + 1
    assert (
        api.post("/api/v1/watched-images", {"reference": "a/b", "kind": "base"}, format="json", **AGENT).status_code
        == 403
    )
    assert api.delete(f"/api/v1/watched-images/{pk}", **bearer(world.keys["acme-admin"])).status_code == 403
    assert api.delete(f"/api/v1/watched-images/{pk}", **op).status_code == 204
    assert WatchedImage.objects.count() == before
    assert api.get(f"/api/v1/watched-images/{pk}", **op).status_code == 404
