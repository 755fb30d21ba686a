"""The admin's image parts (docs/images.md): operators edit the watched images (the
reference checked by the same grammar as the API); image requests are read only."""

from __future__ import annotations

import pytest

from apps.nodes import images
from apps.nodes.models import ImageRequest, WatchedImage
from tests.factories import make_node
from tests.nodes.image_support import seed_default_watched_images

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def defaults():
    seed_default_watched_images()


@pytest.fixture
def admin(client, world):
    client.force_login(world.operator)
    return client


def test_the_watched_images_are_edited_in_the_admin(admin):
    listing = admin.get("/admin/nodes/watchedimage/").content.decode()
    assert "vllm/vllm-openai" in listing and "every vendor" in listing
    before = WatchedImage.objects.count()
    bad = admin.post("/admin/nodes/watchedimage/add/", {"vendor": "", "reference": "Not A Ref", "kind": "base"})
    assert bad.status_code == 200 and "is not an image reference" in bad.content.decode()
    assert WatchedImage.objects.count() == before
    good = admin.post(
        "/admin/nodes/watchedimage/add/", {"vendor": "nvidia", "reference": "127.0.0.1:5000/ours/x:1", "kind": "engine"}
    )
    assert good.status_code == 302 and WatchedImage.objects.count() == before + 1


def test_image_requests_are_read_only_in_the_admin(admin):
    row = images.request_pull(make_node("adm-1", 1), "repo/x:1", requested_by="op")
    ImageRequest.objects.filter(pk=row.pk).update(progress={"layers_done": 1, "layers_total": 3})
    listing = admin.get("/admin/nodes/imagerequest/").content.decode()
    assert "repo/x:1" in listing and "1/3 layers" in listing
    assert admin.get("/admin/nodes/imagerequest/add/").status_code == 403
    page = admin.get(f"/admin/nodes/imagerequest/{row.pk}/change/")
    assert page.status_code == 200 and 'name="status"' not in page.content.decode()
