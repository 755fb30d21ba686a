"""The operators' admin creates and deletes tenants through the same services as the API."""

import pytest
from django.db import connection

from apps.tasks.choices import TaskStatus
from apps.tenants.models import ApiKey, Membership, Tenant
from tests.factories import TaskFactory

pytestmark = pytest.mark.django_db


def schema_exists(name):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [name])
        return cursor.fetchone() is not None


@pytest.fixture
def admin_client(client, world):
    client.force_login(world.operator)
    return client


def test_admin_add_creates_the_tenant_and_its_schema(admin_client):
    response = admin_client.post(
        "/admin/tenants/tenant/add/",
        {
            "name": "Delta",
            "slug": "delta",
            "max_gpus": "4",
            "memberships-TOTAL_FORMS": "0",
            "memberships-INITIAL_FORMS": "0",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant = Tenant.objects.get(slug="delta")
    assert tenant.max_gpus == 4
    assert schema_exists("t_delta")


def test_admin_add_refuses_a_duplicate_name(admin_client):
    response = admin_client.post(
        "/admin/tenants/tenant/add/",
        {"name": "acme", "slug": "acme-again", "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"},
    )
    assert response.status_code == 200
    assert "A tenant with this name already exists." in response.content.decode()
    assert not Tenant.objects.filter(slug="acme-again").exists()


def test_admin_delete_is_refused_while_tasks_are_active(admin_client, world):
    tenant = world.tenants["acme"]
    TaskFactory(tenant=tenant, status=TaskStatus.RUNNING)
    response = admin_client.post(f"/admin/tenants/tenant/{tenant.pk}/delete/", {"post": "yes"}, follow=True)
    assert "has active tasks" in response.content.decode()
    assert Tenant.objects.filter(pk=tenant.pk).exists() and schema_exists("t_acme")


def test_admin_delete_drops_the_schema(admin_client, world):
    tenant = world.tenants["beta"]
    response = admin_client.post(f"/admin/tenants/tenant/{tenant.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Tenant.objects.filter(pk=tenant.pk).exists()
    assert not schema_exists("t_beta")


def test_admin_revokes_keys_through_the_service(admin_client, world):
    key = ApiKey.objects.get(user__username="acme-member")
    response = admin_client.post(
        "/admin/tenants/apikey/", {"action": "revoke", "_selected_action": [key.pk]}, follow=True
    )
    assert response.status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_admin_cannot_remove_the_last_admin(admin_client, world):
    membership = Membership.objects.get(user__username="acme-admin")
    response = admin_client.post(f"/admin/tenants/membership/{membership.pk}/delete/", {"post": "yes"}, follow=True)
    page = response.content.decode()
    assert "last admin" in page and "deleted" not in page.lower()
    assert Membership.objects.filter(pk=membership.pk).exists()
    response = admin_client.post(f"/admin/tenants/membership/{membership.pk}/change/", {"role": "viewer"})
    assert response.status_code == 200 and "last admin" in response.content.decode()
    membership.refresh_from_db()
    assert membership.role == "admin"


def test_admin_adds_members_through_the_service(admin_client, world):
    from tests.factories import UserFactory

    user = UserFactory(username="erin")
    tenant = world.tenants["acme"]
    response = admin_client.post(
        "/admin/tenants/membership/add/", {"user": user.pk, "tenant": tenant.pk, "role": "member"}
    )
    assert response.status_code == 302
    assert Membership.objects.filter(user=user, tenant=tenant, role="member").exists()
    response = admin_client.post(
        "/admin/tenants/membership/add/", {"user": user.pk, "tenant": tenant.pk, "role": "viewer"}
    )
    assert response.status_code == 200 and "already a member" in response.content.decode()
