"""The operators' admin for alerts: a list with filters, and resolve / acknowledge
actions that go through the same services as the API."""

import pytest

from apps.alerts.models import Alert
from apps.alerts.services import raise_alert

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, world):
    client.force_login(world.operator)
    return client


def raised(key, **fields):
    raise_alert(
        key=key, type="NODE_OFFLINE", severity="error", scope="node", node_id=key, message=f"{key} silent", **fields
    )
    return Alert.objects.get(key=key)


def test_the_list_filters_by_state_and_type(admin_client):
    raised("n1")
    ended = raised("n2")
    Alert.objects.filter(pk=ended.pk).update(state="RECOVERED")
    page = admin_client.get("/admin/alerts/alert/", {"state__exact": "ACTIVE", "type__exact": "NODE_OFFLINE"})
    assert page.status_code == 200
    body = page.content.decode()
    assert ">n1<" in body and ">n2<" not in body


def test_resolving_from_the_admin_goes_through_the_service(admin_client, world):
    first, second = raised("n1"), raised("n2")
    Alert.objects.filter(pk=second.pk).update(state="RECOVERED")
    response = admin_client.post(
        "/admin/alerts/alert/",
        {
            "action": "resolve",
            "_selected_action": [first.pk, second.pk],
        },
        follow=True,
    )
    assert "Resolved 1 alert(s); 1 had already ended." in response.content.decode()
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.state, first.resolved_by, first.ended_at is not None) == ("RESOLVED", world.operator, True)
    assert second.state == "RECOVERED" and second.resolved_by is None


def test_acknowledging_from_the_admin(admin_client, world):
    alert = raised("n1")
    admin_client.post("/admin/alerts/alert/", {"action": "acknowledge", "_selected_action": [alert.pk]})
    alert.refresh_from_db()
    assert alert.acknowledged_by == world.operator and alert.state == "ACTIVE"


def test_alerts_cannot_be_added_edited_or_deleted_by_hand(admin_client):
    alert = raised("n1")
    assert admin_client.get("/admin/alerts/alert/add/").status_code == 403
    assert admin_client.post(f"/admin/alerts/alert/{alert.pk}/delete/", {"post": "yes"}).status_code == 403
    admin_client.post(f"/admin/alerts/alert/{alert.pk}/change/", {"state": "RESOLVED"})
    alert.refresh_from_db()
    assert alert.state == "ACTIVE"


def test_a_tenant_user_cannot_open_the_admin(client, world):
    client.force_login(world.users["acme-admin"])
    assert client.get("/admin/alerts/alert/").status_code == 302  # to the admin's sign-in
