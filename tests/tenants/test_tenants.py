import pytest
from django.db import connection
from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent, Secret
from apps.confidential.services import put_secret, read_secret
from apps.tasks.choices import ACTIVE, TERMINAL
from apps.tenants import services
from apps.tenants.models import Tenant
from apps.tenants.selectors import tenants_may_share
from tests.factories import TaskFactory
from tests.headers import bearer

pytestmark = pytest.mark.django_db


def schema_exists(name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [name])
        return cursor.fetchone() is not None


def table_in_schema(schema: str, table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = %s", [schema, table])
        return cursor.fetchone() is not None


def test_creating_a_tenant_creates_its_migrated_schema(world, api):
    response = api.post(
        "/api/v1/tenants", {"name": "Gamma Labs", "slug": "gamma-labs"}, format="json", **bearer(world.operator_key)
    )
    assert response.status_code == 201, response.content
    tenant = Tenant.objects.get(slug="gamma-labs")
    assert tenant.schema_name == "t_gamma_labs"
    assert schema_exists("t_gamma_labs")
    assert table_in_schema("t_gamma_labs", "secrets") and table_in_schema("t_gamma_labs", "audit_events")
    # confidential tables never exist in public
    assert not table_in_schema("public", "secrets")
    with schema_context(tenant.schema_name):
        assert AuditEvent.objects.filter(action="tenant.created").count() == 1


def test_a_new_tenant_schema_holds_only_its_own_apps_and_a_later_migrate_completes_it(world):
    """Creating a tenant migrates only TENANT_APPS in its schema (fast); the next
    migrate_schemas records the rest there without creating a shared table in it."""
    from django.core.management import call_command
    from django.db import connection

    from apps.tenants.services import create_tenant

    tenant = create_tenant(name="Quick", slug="quick")
    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT app FROM t_quick.django_migrations")
        assert {app for (app,) in cursor.fetchall()} == {"confidential"}
        cursor.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 't_quick'")
        before = {name for (name,) in cursor.fetchall()}
    call_command("migrate_schemas", tenant=True, schema_name=tenant.schema_name, interactive=False, verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 't_quick'")
        assert {name for (name,) in cursor.fetchall()} == before  # nothing shared landed in the tenant's schema
        cursor.execute("SELECT count(DISTINCT app) FROM t_quick.django_migrations")
        assert cursor.fetchone()[0] > 5
    connection.set_schema_to_public()


@pytest.mark.parametrize(
    "body",
    [
        {"name": "Acme", "slug": "acme-two"},  # same name
        {"name": "ACME", "slug": "acme-three"},  # same name, other case
        {"name": "Acme Two", "slug": "acme"},  # same slug
    ],
)
def test_a_tenant_cannot_be_created_twice(world, api, body):
    response = api.post("/api/v1/tenants", body, format="json", **bearer(world.operator_key))
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "tenant_exists"
    assert Tenant.objects.count() == 2


@pytest.mark.parametrize("slug", ["A", "ab", "-abc", "abc-", "has space", "UPPER", "x" * 41, "1abc", "a_b"])
def test_bad_slugs_are_refused_and_nothing_is_created(world, api, slug):
    response = api.post("/api/v1/tenants", {"name": "Gamma", "slug": slug}, format="json", **bearer(world.operator_key))
    assert response.status_code == 400
    assert "slug" in response.json()["error"]["fields"]
    assert Tenant.objects.count() == 2


def test_data_in_one_tenant_schema_is_invisible_from_another(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    put_secret(acme, "registry-password", "hunter2")
    assert read_secret(acme, "registry-password") == "hunter2"
    assert read_secret(beta, "registry-password") is None
    with schema_context(beta.schema_name):
        assert not Secret.objects.exists()
    with schema_context(acme.schema_name):
        assert Secret.objects.count() == 1
    # and the public schema has no such table at all
    assert connection.schema_name == "public"


def test_audit_log_api_reads_only_the_tenants_own_schema(world, api):
    api.post("/api/v1/tenants/acme/members", {"username": "newbie"}, format="json", **bearer(world.keys["acme-admin"]))
    acme_log = api.get("/api/v1/tenants/acme/audit", **bearer(world.keys["acme-admin"])).json()["results"]
    beta_log = api.get("/api/v1/tenants/beta/audit", **bearer(world.keys["beta-admin"])).json()["results"]
    assert any(e["action"] == "member.added" and e["target"] == "newbie" for e in acme_log)
    assert not any(e["target"] == "newbie" for e in beta_log)
    assert acme_log[0]["actor"].startswith("acme-admin (key sk-tenant-")


@pytest.mark.parametrize("status", ACTIVE)
def test_deleting_a_tenant_with_active_tasks_is_refused(world, api, status):
    task = TaskFactory(tenant=world.tenants["acme"], status=status)
    response = api.delete("/api/v1/tenants/acme", **bearer(world.operator_key))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "tenant_has_active_tasks"
    assert f"#{task.pk} ({status})" in error["message"]
    assert Tenant.objects.filter(slug="acme").exists() and schema_exists("t_acme")


def test_deleting_a_tenant_drops_its_schema_and_what_it_owns(world, api):
    for status in TERMINAL:
        TaskFactory(tenant=world.tenants["beta"], status=status)
    response = api.delete("/api/v1/tenants/beta", **bearer(world.operator_key))
    assert response.status_code == 204
    assert not Tenant.objects.filter(slug="beta").exists()
    assert not schema_exists("t_beta")
    # its members' keys are gone with it
    response = api.get("/api/v1/me", **bearer(world.keys["beta-admin"]))
    assert response.status_code == 401


def test_operator_sets_quotas(world, api):
    response = api.patch(
        "/api/v1/tenants/acme", {"max_gpus": 8, "max_concurrent_tasks": 20}, format="json", **bearer(world.operator_key)
    )
    assert response.status_code == 200
    assert response.json()["max_gpus"] == 8
    tenant = Tenant.objects.get(slug="acme")
    assert (tenant.max_gpus, tenant.max_concurrent_tasks, tenant.max_gpu_memory_mb) == (8, 20, None)
    response = api.patch("/api/v1/tenants/acme", {"max_gpus": -1}, format="json", **bearer(world.operator_key))
    assert response.status_code == 400
    assert Tenant.objects.get(slug="acme").max_gpus == 8


def test_tenant_groups_decide_who_may_share_a_card(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    assert tenants_may_share(acme.pk, acme.pk)
    assert not tenants_may_share(acme.pk, beta.pk)
    services.save_group(None, name="shared", tenants=[acme, beta])
    assert tenants_may_share(acme.pk, beta.pk)


def test_duplicate_tenant_group_is_a_conflict(world, api):
    headers = bearer(world.operator_key)
    assert api.post("/api/v1/tenant-groups", {"name": "g1"}, format="json", **headers).status_code == 201
    response = api.post("/api/v1/tenant-groups", {"name": "g1"}, format="json", **headers)
    assert response.status_code == 409


def test_quotas_can_be_given_at_creation(world, api):
    body = {"name": "Quota", "slug": "quota", "max_gpus": 4, "max_gpu_memory_mb": 81920, "max_concurrent_tasks": 3}
    response = api.post("/api/v1/tenants", body, format="json", **bearer(world.operator_key))
    assert response.status_code == 201, response.content
    tenant = Tenant.objects.get(slug="quota")
    assert (tenant.max_gpus, tenant.max_gpu_memory_mb, tenant.max_concurrent_tasks) == (4, 81920, 3)
