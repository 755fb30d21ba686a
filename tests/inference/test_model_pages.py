"""The portal's models pages with Django's test client: the list with where each model is
cached, scoped as the API is; the register form says what the API says and writes
nothing on an error; the detail; deletion by members, not viewers; and the node page's
delete with the models pre-check and its force box."""

import pytest
from django.utils.html import escape

from apps.inference.models import Model
from apps.nodes.model_cache import CACHED_MODELS_LABEL
from apps.nodes.models import Node
from tests.factories import make_node
from tests.headers import bearer
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

FORM = {
    "name": "qwen3-8b",
    "source_kind": "path",
    "source": "/data/heteroflow/model-cache/Qwen3-8B",
    "format": "safetensors",
    "size_bytes": "16000000000",
    "engines": ["vllm", "sglang"],
    "nodes": "shared-1",
}


def model(tenant, name, **fields) -> Model:
    return Model.objects.create(
        tenant=tenant, name=name, **{"source_kind": "hub", "source": "org/m", "format": "gguf", **fields}
    )


@pytest.mark.parametrize("url", ["/portal/models/", "/portal/models/new/", "/portal/models/1/"])
def test_an_anonymous_visitor_is_sent_to_the_sign_in_page(client, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=")


def test_the_list_shows_the_tenants_models_where_cached_and_filters(client, world):
    make_node("shared-1", 2, name="alpha", labels={CACHED_MODELS_LABEL: "ours"})
    make_node("beta-1", 2, tenant=world.tenants["beta"], labels={CACHED_MODELS_LABEL: "ours"})
    ours = model(world.tenants["acme"], "ours", engines=["llama.cpp"])
    model(world.tenants["acme"], "st", format="safetensors")
    model(world.tenants["beta"], "theirs")
    viewer = signed_in(client, world.users["acme-viewer"])
    html = page(viewer, "/portal/models/")
    assert 'href="/portal/models/"' in html and 'aria-current="page">Models<' in html
    assert f'data-model="{ours.pk}"' in html and "theirs" not in html and ">st<" in html
    assert ">alpha</a>" in html and "beta-1" not in html  # another tenant's dedicated node never shows
    assert "Register a model" not in html  # viewers only look
    filtered = page(viewer, "/portal/models/?format=safetensors")
    assert ">st<" in filtered and f'data-model="{ours.pk}"' not in filtered
    assert page(viewer, "/portal/models/?engine=llama.cpp").count("data-model=") == 1


def test_registering_through_the_form_writes_the_model_the_api_would(client, world):
    make_node("shared-1", 2)
    member = signed_in(client, world.users["acme-member"])
    html = page(member, "/portal/models/new/")
    assert 'id="model-form"' in html and 'name="csrfmiddlewaretoken"' in html
    response = member.post("/portal/models/new/", FORM)
    assert response.status_code == 302, response.content.decode()
    registered = Model.objects.get(name="qwen3-8b")
    assert response["Location"] == f"/portal/models/{registered.pk}/"
    assert (registered.tenant, registered.engines, registered.size_bytes) == (
        world.tenants["acme"],
        ["vllm", "sglang"],
        16_000_000_000,
    )
    assert list(registered.nodes.values_list("pk", flat=True)) == ["shared-1"]
    again = member.post("/portal/models/new/", FORM)
    assert again.status_code == 400 and "already has a model named" in again.content.decode()
    assert Model.objects.count() == 1


def test_the_form_says_what_the_api_says_and_writes_nothing(client, world, api):
    bad = {"name": "has space", "source_kind": "path", "source": "relative", "format": "zip", "engines": ["warp"]}
    api_fields = api.post("/api/v1/models", bad, format="json", **bearer(world.keys["acme-member"])).json()["error"][
        "fields"
    ]
    assert set(api_fields) == {"name", "format", "engines"}
    member = signed_in(client, world.users["acme-member"])
    response = member.post("/portal/models/new/", bad)
    assert response.status_code == 400
    html = response.content.decode()
    assert "The model was not registered." in html
    for field, messages in api_fields.items():
        for message in messages:
            assert f'data-errors="{field}"' in html and escape(message) in html, (field, message)
    unknown_node = member.post("/portal/models/new/", FORM | {"nodes": "nowhere"})
    assert unknown_node.status_code == 400 and "No node &#x27;nowhere&#x27;." in unknown_node.content.decode()
    assert not Model.objects.exists()


def test_viewers_get_no_form(client, world):
    viewer = signed_in(client, world.users["acme-viewer"])
    assert viewer.get("/portal/models/new/").status_code == 403
    assert viewer.post("/portal/models/new/", FORM).status_code == 403
    assert not Model.objects.exists()


def test_the_detail_shows_where_it_is_cached_and_another_tenants_is_not_found(client, world):
    make_node("n1", 2, name="alpha", discovered_models=[{"name": "x", "path": "/m/ours"}])
    ours = model(world.tenants["acme"], "ours", source_kind="path", source="/m/ours")
    theirs = model(world.tenants["beta"], "theirs")
    member = signed_in(client, world.users["acme-member"])
    html = page(member, f"/portal/models/{ours.pk}/")
    assert 'data-node="n1"' in html and "<code>/m/ours</code>" in html and "Delete" in html
    page(member, f"/portal/models/{theirs.pk}/", status=404)


def test_members_delete_viewers_cannot(client, world):
    ours = model(world.tenants["acme"], "ours")
    viewer = signed_in(client, world.users["acme-viewer"])
    assert "Delete" not in page(viewer, f"/portal/models/{ours.pk}/")
    assert viewer.post(f"/portal/models/{ours.pk}/delete/").status_code == 403
    assert Model.objects.filter(pk=ours.pk).exists()
    member = signed_in(client, world.users["acme-member"])
    response = member.post(f"/portal/models/{ours.pk}/delete/", follow=True)
    assert response.status_code == 200 and "Model &#x27;ours&#x27; deleted." in response.content.decode()
    assert not Model.objects.exists()


def test_the_node_page_delete_shows_the_models_409_and_force_removes_them(client, world, api):
    node = make_node("shared-2", 2)
    registered = model(world.tenants["acme"], "pinned")
    registered.nodes.set([node])
    answer = api.delete("/api/v1/nodes/shared-2", **bearer(world.operator_key)).json()["error"]["message"]
    operator = signed_in(client, world.operator)
    assert "Also remove the models registered on it" in page(operator, "/portal/nodes/shared-2/")
    html = operator.post("/portal/nodes/shared-2/delete/", follow=True).content.decode()
    assert escape(answer) in html and Node.objects.filter(pk="shared-2").exists()
    html = operator.post("/portal/nodes/shared-2/delete/", {"force": "true"}, follow=True).content.decode()
    assert "Models deleted with it: acme/pinned." in html
    assert not Node.objects.filter(pk="shared-2").exists() and not Model.objects.exists()


def test_the_admin_lists_and_deletes_models_but_registers_none(client, world):
    registered = model(world.tenants["acme"], "ours")
    registered.nodes.set([make_node("n1", 1)])
    admin = signed_in(client, world.operator)
    html = page(admin, "/admin/inference/model/?format__exact=gguf")
    assert ">ours<" in html
    assert "n1" in page(admin, f"/admin/inference/model/{registered.pk}/change/")
    assert admin.get("/admin/inference/model/add/").status_code == 403
    admin.post(f"/admin/inference/model/{registered.pk}/delete/", {"post": "yes"})
    assert not Model.objects.exists()


def test_the_detail_form_changes_size_engines_and_nodes_as_patch_does(client, world):
    make_node("shared-1", 1)
    make_node("beta-1", 1, tenant=world.tenants["beta"])
    ours = model(world.tenants["acme"], "ours", engines=["llama.cpp"], size_bytes=5)
    member = signed_in(client, world.users["acme-member"])
    html = page(member, f"/portal/models/{ours.pk}/")
    assert 'id="model-edit"' in html and 'value="llama.cpp" checked' in html
    saved = member.post(
        f"/portal/models/{ours.pk}/edit/", {"size_bytes": "", "engines": ["ollama"], "nodes": "shared-1"}, follow=True
    )
    assert "Model &#x27;ours&#x27; saved." in saved.content.decode()
    ours.refresh_from_db()
    assert (ours.size_bytes, ours.engines) == (None, ["ollama"])
    assert list(ours.nodes.values_list("pk", flat=True)) == ["shared-1"]
    bad_engine = member.post(f"/portal/models/{ours.pk}/edit/", {"engines": ["warp"]}, follow=True)
    assert "engines: 0: &quot;warp&quot; is not a valid choice." in bad_engine.content.decode()
    their_node = member.post(f"/portal/models/{ours.pk}/edit/", {"engines": ["vllm"], "nodes": "beta-1"}, follow=True)
    assert "nodes: No node &#x27;beta-1&#x27;." in their_node.content.decode()
    ours.refresh_from_db()
    assert ours.engines == ["ollama"] and list(ours.nodes.values_list("pk", flat=True)) == ["shared-1"]
    viewer = signed_in(client, world.users["acme-viewer"])
    assert 'id="model-edit"' not in page(viewer, f"/portal/models/{ours.pk}/")
    assert viewer.post(f"/portal/models/{ours.pk}/edit/", {"engines": []}).status_code == 403


def test_the_detail_links_the_tasks_that_serve_the_model(client, world):
    make_node("n1", 1, discovered_models=[{"name": "ours", "path": "ours", "served": True, "task_id": 7, "port": 8001}])
    ours = model(world.tenants["acme"], "ours")
    html = page(signed_in(client, world.users["acme-member"]), f"/portal/models/{ours.pk}/")
    assert 'href="/portal/tasks/7/">#7</a>' in html
