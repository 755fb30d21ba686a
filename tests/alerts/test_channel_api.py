"""The notification channel API: who may do what (404 outside one's scope), strict input
(400 naming the field, nothing written), the secret shown once and kept in the tenant's
schema, the audit log, and the admin."""

from __future__ import annotations

import pytest
from django.db import connection
from django_tenants.utils import schema_context

from apps.alerts.models import NotificationChannel, NotificationDelivery
from apps.confidential.models import AuditEvent
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

CHANNELS = "/api/v1/alerts/channels"
HOOK_URL = "https://hooks.example.test/services/T000/B000/xoxb-url-token"


def as_(world, api, who):
    """Request headers for principal `who` (configures `api` for sessions)."""
    if who == "anonymous":
        return {}
    if who == "agent":
        return AGENT
    if who == "operator":
        return bearer(world.operator_key)
    if who.endswith("-session"):
        api.force_login(world.users[who.removesuffix("-session")])
        return {}
    return bearer(world.keys[who])


def create(api, world, who="acme-admin", **body):
    default = {"name": "hook", "kind": "webhook"} | (
        {"url": HOOK_URL} if body.get("kind", "webhook") == "webhook" else {}
    )
    body = default | body
    return api.post(CHANNELS, body, format="json", **as_(world, api, who))


def created(api, world, who="acme-admin", **body) -> dict:
    response = create(api, world, who, **body)
    assert response.status_code == 201, response.content
    return response.json()


def sql(query, params=()):
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return cursor.fetchall()


def written(world) -> tuple:
    """Everything a channel request could write."""
    counts = [
        NotificationChannel.objects.count(),
        NotificationDelivery.objects.count(),
        sql("SELECT count(*) FROM operator_channel_secrets")[0][0],
    ]
    for tenant in world.tenants.values():
        counts += [
            sql(f'SELECT count(*) FROM "{tenant.schema_name}".channel_secrets')[0][0],
            sql(f'SELECT count(*) FROM "{tenant.schema_name}".audit_events')[0][0],
        ]
    return tuple(counts)


# --- who may do what ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "status"),
    [
        ("anonymous", 401),
        ("agent", 403),
        ("acme-member", 403),
        ("acme-viewer", 403),
        ("acme-admin", 200),
        ("acme-admin-session", 200),
        ("operator", 200),
    ],
)
def test_listing_channels(world, api, who, status):
    mine = created(api, world, "acme-admin", name="acme-hook")
    created(api, world, "beta-admin", name="beta-hook")
    created(api, world, "operator", name="ops-hook")
    response = api.get(CHANNELS, **as_(world, api, who))
    assert response.status_code == status, response.content
    if status != 200:
        return
    names = {item["name"] for item in response.json()["results"]}
    if who == "operator":
        assert names == {"acme-hook", "beta-hook", "ops-hook"}
        only_beta = api.get(CHANNELS, {"tenant": "beta"}, **as_(world, api, who)).json()["results"]
        assert [item["name"] for item in only_beta] == ["beta-hook"]
    else:
        assert names == {"acme-hook"}  # never another tenant's, never the operators'
        assert response.json()["results"][0]["url"] == HOOK_URL and response.json()["results"][0]["id"] == mine["id"]


@pytest.mark.parametrize(
    ("who", "acme_channel", "ops_channel"),
    [
        ("acme-admin", 200, 404),
        ("acme-admin-session", 200, 404),
        ("beta-admin", 404, 404),
        ("acme-member", 403, 404),
        ("acme-viewer", 403, 404),
        ("beta-viewer", 404, 404),
        ("operator", 200, 200),
        ("agent", 403, 403),
        ("anonymous", 401, 401),
    ],
)
def test_reading_one_channel(world, api, who, acme_channel, ops_channel):
    acme = created(api, world, "acme-admin")
    ops = created(api, world, "operator", name="ops")
    headers = as_(world, api, who)
    assert api.get(f"{CHANNELS}/{acme['id']}", **headers).status_code == acme_channel
    assert api.get(f"{CHANNELS}/{ops['id']}", **headers).status_code == ops_channel
    assert api.get(f"{CHANNELS}/{ops['id'] + 1000}", **headers).status_code in (401, 403, 404)


@pytest.mark.parametrize("who", ["beta-admin", "acme-member", "acme-viewer", "agent"])
def test_changing_a_channel_takes_its_tenants_admin_or_an_operator(world, api, who):
    channel = created(api, world, "acme-admin")
    expected = 404 if who == "beta-admin" else 403
    headers = as_(world, api, who)
    before = written(world)
    url = f"{CHANNELS}/{channel['id']}"
    assert api.patch(url, {"enabled": False}, format="json", **headers).status_code == expected
    assert api.post(f"{url}/test", format="json", **headers).status_code == expected
    assert api.post(f"{url}/rotate-secret", format="json", **headers).status_code == expected
    assert api.get(f"{url}/deliveries", **headers).status_code == expected
    assert api.delete(url, **headers).status_code == expected
    assert written(world) == before
    assert NotificationChannel.objects.get(pk=channel["id"]).enabled


@pytest.mark.parametrize("who", ["acme-member", "acme-viewer", "agent", "anonymous"])
def test_only_admins_and_operators_create_channels(world, api, who):
    before = written(world)
    assert create(api, world, who).status_code == (401 if who == "anonymous" else 403)
    assert written(world) == before


def test_where_a_new_channel_belongs(world, api):
    assert created(api, world, "acme-admin")["tenant"] == "acme"
    assert created(api, world, "acme-admin", name="explicit", tenant="acme")["tenant"] == "acme"
    assert created(api, world, "operator", name="ops")["tenant"] is None
    assert created(api, world, "operator", name="for-beta", tenant="beta")["tenant"] == "beta"
    before = written(world)
    # another tenant's slug reads as an unknown one: nothing tells acme that beta exists
    other, unknown = create(api, world, "acme-admin", tenant="beta"), create(api, world, "acme-admin", tenant="nope")
    assert other.status_code == unknown.status_code == 400
    assert other.json()["error"]["fields"]["tenant"] == ["No tenant 'beta'."]
    assert create(api, world, "acme-admin", name="no-tenant", tenant=None).json()["error"]["fields"].keys() == {
        "tenant"
    }
    assert create(api, world, "operator", tenant="nope").status_code == 400
    assert written(world) == before


def test_names_are_unique_per_tenant(world, api):
    created(api, world, "acme-admin", name="pager")
    created(api, world, "beta-admin", name="pager")
    created(api, world, "operator", name="pager")
    before = written(world)
    for who in ("acme-admin", "operator"):
        response = create(api, world, who, name="pager")
        assert response.status_code == 409 and response.json()["error"]["code"] == "channel_exists"
    assert written(world) == before
    other = created(api, world, "acme-admin", name="other")
    assert (
        api.patch(
            f"{CHANNELS}/{other['id']}", {"name": "pager"}, format="json", **as_(world, api, "acme-admin")
        ).status_code
        == 409
    )
    assert NotificationChannel.objects.filter(name="pager").count() == 3


# --- strict input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://hooks.example.test/x"}, "url"),
        ({"url": "javascript:alert(1)"}, "url"),
        ({"url": "file:///etc/passwd"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"url": "https://" + "a" * 2000 + ".test/"}, "url"),
        ({"url": None}, "url"),
        ({"url": ""}, "url"),
        ({"min_severity": "fatal"}, "min_severity"),
        ({"types": ["NODE_OFFLINE", "NODE_ON_FIRE"]}, "types"),
        ({"types": "NODE_OFFLINE"}, "types"),
        ({"kind": "pager"}, "kind"),
        ({"kind": "email"}, "recipients"),  # an e-mail channel needs recipients
        ({"kind": "email", "recipients": ["ok@example.test"], "url": HOOK_URL}, "url"),  # and has no URL
        ({"recipients": ["ok@example.test"]}, "recipients"),  # a webhook has none
        ({"name": ""}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"enabled": "perhaps"}, "enabled"),
        ({"colour": "red"}, "colour"),
        ({"secret": "my-own-secret"}, "secret"),  # the server makes secrets
        ({"consecutive_failures": 0}, "consecutive_failures"),
    ],
)
def test_bad_input_is_400_naming_the_field_and_writes_nothing(world, api, body, field):
    before = written(world)
    response = create(api, world, "acme-admin", **body)
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"]
    assert written(world) == before


def test_url_is_required_for_a_webhook(world, api):
    before = written(world)
    response = api.post(CHANNELS, {"name": "hook", "kind": "webhook"}, format="json", **as_(world, api, "acme-admin"))
    assert response.status_code == 400 and "url" in response.json()["error"]["fields"]
    assert written(world) == before


@pytest.mark.parametrize(
    "recipients",
    [
        [],
        ["not-an-address"],
        ["ok@example.test", "bad@"],
        ["a@b.test\nBcc: x@y.test"],
        [f"r{i}@example.test" for i in range(21)],
        "ok@example.test",
    ],
)
def test_bad_recipients_are_400_and_write_nothing(world, api, recipients):
    before = written(world)
    response = api.post(
        CHANNELS,
        {"name": "mail", "kind": "email", "recipients": recipients},
        format="json",
        **as_(world, api, "acme-admin"),
    )
    assert response.status_code == 400 and "recipients" in response.json()["error"]["fields"]
    assert written(world) == before


def test_an_email_channel(world, api):
    body = created(
        api,
        world,
        "acme-admin",
        name="mail",
        kind="email",
        recipients=["Oncall@Example.test", "oncall@example.test", "lead@example.test"],
        min_severity="error",
        types=["TASK_FAILED", "TASK_FAILED"],
    )
    body.pop("url", None)
    channel = NotificationChannel.objects.get(pk=body["id"])
    assert channel.recipients == ["Oncall@Example.test", "lead@example.test"]  # one per address
    assert channel.types == ["TASK_FAILED"] and channel.min_severity == "error" and channel.kind == "email"


def test_a_patch_changes_what_it_names_and_refuses_bad_input_whole(world, api):
    headers = as_(world, api, "acme-admin")
    channel = created(api, world, "acme-admin")
    url = f"{CHANNELS}/{channel['id']}"
    new_url = "https://hooks.example.test/other?token=second-url-token"
    response = api.patch(
        url,
        {"url": new_url, "min_severity": "critical", "types": ["GPU_LOST"], "enabled": False},
        format="json",
        **headers,
    )
    assert response.status_code == 200, response.content
    body = api.get(url, **headers).json()
    assert (body["url"], body["min_severity"], body["types"], body["enabled"]) == (
        new_url,
        "critical",
        ["GPU_LOST"],
        False,
    )
    assert body["name"] == "hook"  # untouched

    before = written(world)
    for bad, field in (
        ({"url": "gopher://x.test/", "enabled": True}, "url"),
        ({"kind": "email"}, "kind"),
        ({"tenant": "beta"}, "tenant"),
        ({"recipients": ["a@b.test"]}, "recipients"),
        ({"types": ["NOPE"], "name": "renamed"}, "types"),
    ):
        response = api.patch(url, bad, format="json", **headers)
        assert response.status_code == 400 and field in response.json()["error"]["fields"], (bad, response.content)
    assert written(world) == before
    assert api.get(url, **headers).json() == body

    mail = created(api, world, "acme-admin", name="mail", kind="email", recipients=["a@example.test"])
    response = api.patch(f"{CHANNELS}/{mail['id']}", {"url": "https://x.example.test/"}, format="json", **headers)
    assert response.status_code == 400 and "url" in response.json()["error"]["fields"]


# --- the secret ----------------------------------------------------------------------------------


def test_the_secret_is_shown_once_and_kept_in_the_tenants_schema_only(world, api):
    body = created(api, world, "acme-admin")
    secret, channel_id = body["secret"], body["id"]
    assert isinstance(secret, str) and len(secret) >= 40
    assert body["url"] == HOOK_URL

    headers = as_(world, api, "acme-admin")
    for path in (f"{CHANNELS}/{channel_id}", CHANNELS, f"{CHANNELS}/{channel_id}/deliveries"):
        response = api.get(path, **headers)
        assert response.status_code == 200 and secret not in response.content.decode()
    assert "secret" not in api.get(f"{CHANNELS}/{channel_id}", **headers).json()

    # where it is: the tenant's own schema, nowhere in public, not in the other tenant's
    assert sql("SELECT secret, url FROM t_acme.channel_secrets WHERE channel_id = %s", [channel_id]) == [
        (secret, HOOK_URL)
    ]
    assert sql("SELECT count(*) FROM t_beta.channel_secrets WHERE channel_id = %s", [channel_id]) == [(0,)]
    assert sql("SELECT count(*) FROM public.operator_channel_secrets WHERE channel_id = %s", [channel_id]) == [(0,)]
    assert sql("SELECT to_regclass('public.channel_secrets')") == [(None,)]  # no such table in public at all
    (row,) = sql("SELECT alert_channels::text FROM public.alert_channels WHERE id = %s", [channel_id])
    assert secret not in row[0] and "xoxb-url-token" not in row[0]  # the URL's token neither

    # the operators' channels keep theirs in public (they belong to no tenant)
    ops = created(api, world, "operator", name="ops")
    assert sql("SELECT secret FROM public.operator_channel_secrets WHERE channel_id = %s", [ops["id"]]) == [
        (ops["secret"],)
    ]
    assert sql("SELECT count(*) FROM t_acme.channel_secrets WHERE channel_id = %s", [ops["id"]]) == [(0,)]

    # e-mail channels have none
    mail = created(api, world, "acme-admin", name="mail", kind="email", recipients=["a@example.test"])
    assert mail["secret"] is None and mail["url"] is None


def test_rotating_shows_the_new_secret_once(world, api):
    headers = as_(world, api, "acme-admin")
    body = created(api, world, "acme-admin")
    response = api.post(f"{CHANNELS}/{body['id']}/rotate-secret", format="json", **headers)
    assert response.status_code == 200
    new = response.json()["secret"]
    assert new != body["secret"] and response.json()["id"] == body["id"]
    assert sql("SELECT secret FROM t_acme.channel_secrets WHERE channel_id = %s", [body["id"]]) == [(new,)]
    assert new not in api.get(f"{CHANNELS}/{body['id']}", **headers).content.decode()
    assert (
        api.post(f"{CHANNELS}/{body['id']}/rotate-secret", {"secret": "mine"}, format="json", **headers).status_code
        == 400
    )

    mail = created(api, world, "acme-admin", name="mail", kind="email", recipients=["a@example.test"])
    response = api.post(f"{CHANNELS}/{mail['id']}/rotate-secret", format="json", **headers)
    assert response.status_code == 409 and response.json()["error"]["code"] == "not_a_webhook"


def test_the_admin_shows_channels_without_url_or_secret(world, api):
    body = created(api, world, "acme-admin")
    api.force_login(world.operator)
    for page in ("/admin/alerts/notificationchannel/", f"/admin/alerts/notificationchannel/{body['id']}/change/"):
        response = api.get(page)
        assert response.status_code == 200, page
        html = response.content.decode()
        assert "hook" in html and body["secret"] not in html and "xoxb-url-token" not in html
    assert api.get("/admin/alerts/notificationchannel/add/").status_code == 403  # created through the API only


def test_admin_actions_go_through_the_services(world, api):
    body = created(api, world, "acme-admin")
    api.force_login(world.operator)
    changelist = "/admin/alerts/notificationchannel/"
    response = api.post(changelist, {"action": "disable", "_selected_action": [body["id"]]})
    assert response.status_code == 302
    assert not NotificationChannel.objects.get(pk=body["id"]).enabled
    api.post(changelist, {"action": "send_test", "_selected_action": [body["id"]]})
    assert NotificationDelivery.objects.get(channel_id=body["id"]).event == "test"
    with schema_context("t_acme"):
        actions = list(AuditEvent.objects.filter(details__channel_id=body["id"]).values_list("action", "actor"))
    assert ("alert_channel.updated", "op") in actions and ("alert_channel.tested", "op") in actions

    response = api.post(changelist, {"action": "delete_selected", "_selected_action": [body["id"]], "post": "yes"})
    assert response.status_code == 302
    assert not NotificationChannel.objects.filter(pk=body["id"]).exists()
    assert sql("SELECT count(*) FROM t_acme.channel_secrets WHERE channel_id = %s", [body["id"]]) == [(0,)]


# --- test deliveries, deliveries, delete, audit ------------------------------------------------------


def test_a_test_is_queued_and_listed_with_the_deliveries(world, api):
    headers = as_(world, api, "acme-admin")
    body = created(api, world, "acme-admin")
    url = f"{CHANNELS}/{body['id']}"
    assert api.post(f"{url}/test", {"colour": "red"}, format="json", **headers).status_code == 400
    response = api.post(f"{url}/test", format="json", **headers)
    assert response.status_code == 202
    queued = response.json()
    assert queued["status"] == "pending"
    delivery = NotificationDelivery.objects.get(pk=queued["delivery"])
    assert (delivery.channel_id, delivery.event, delivery.alert_id) == (body["id"], "test", None)

    again = api.post(f"{url}/test", format="json", **headers)
    assert again.status_code == 409 and again.json()["error"]["code"] == "test_pending"

    listed = api.get(f"{url}/deliveries", **headers).json()
    assert listed["count"] == 1
    (item,) = listed["results"]
    assert (item["id"], item["event"], item["status"], item["attempts"], item["alert"]) == (
        delivery.pk,
        "test",
        "pending",
        0,
        None,
    )
    # the operators see it too; another tenant does not
    assert api.get(f"{url}/deliveries", **as_(world, api, "operator")).json()["count"] == 1
    assert api.get(f"{url}/deliveries", **as_(world, api, "beta-admin")).status_code == 404


def test_deleting_a_channel_removes_its_secret_and_deliveries(world, api):
    headers = as_(world, api, "acme-admin")
    body = created(api, world, "acme-admin")
    api.post(f"{CHANNELS}/{body['id']}/test", format="json", **headers)
    assert api.delete(f"{CHANNELS}/{body['id']}", **headers).status_code == 204
    assert not NotificationChannel.objects.filter(pk=body["id"]).exists()
    assert not NotificationDelivery.objects.filter(channel_id=body["id"]).exists()
    assert sql("SELECT count(*) FROM t_acme.channel_secrets WHERE channel_id = %s", [body["id"]]) == [(0,)]
    assert api.get(f"{CHANNELS}/{body['id']}", **headers).status_code == 404


def test_a_tenants_channel_changes_are_in_its_audit_log_without_secrets(world, api):
    headers = as_(world, api, "acme-admin")
    body = created(api, world, "acme-admin")
    url = f"{CHANNELS}/{body['id']}"
    api.patch(
        url,
        {"min_severity": "error", "url": "https://hooks.example.test/new?token=new-url-token"},
        format="json",
        **headers,
    )
    rotated = api.post(f"{url}/rotate-secret", format="json", **headers).json()["secret"]
    api.post(f"{url}/test", format="json", **headers)
    api.delete(url, **headers)
    created(api, world, "operator", name="ops")  # the operators' channels go to no tenant's log

    with schema_context("t_acme"):
        events = list(AuditEvent.objects.filter(action__startswith="alert_channel.").order_by("at", "id"))
    assert [e.action for e in events] == [
        "alert_channel.created",
        "alert_channel.updated",
        "alert_channel.secret_rotated",
        "alert_channel.tested",
        "alert_channel.deleted",
    ]
    assert all(e.actor.startswith("acme-admin (key ") for e in events)
    assert events[0].details["url_host"] == "hooks.example.test" and events[1].details["min_severity"] == "error"
    logged = " ".join(str(e.details) for e in events)
    for secret_text in (body["secret"], rotated, "xoxb-url-token", "new-url-token"):
        assert secret_text not in logged
    with schema_context("t_beta"):
        assert not AuditEvent.objects.filter(action__startswith="alert_channel.").exists()


def test_the_schema_documents_the_channel_endpoints(client):
    paths = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    assert {
        "/api/v1/alerts/channels",
        "/api/v1/alerts/channels/{id}",
        "/api/v1/alerts/channels/{id}/test",
        "/api/v1/alerts/channels/{id}/rotate-secret",
        "/api/v1/alerts/channels/{id}/deliveries",
    } <= set(paths)
    assert set(paths["/api/v1/alerts/channels/{id}"]) >= {"get", "patch", "delete"}
