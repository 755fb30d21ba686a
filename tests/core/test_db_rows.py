"""apps.core.db's row helpers give what the ORM gives: insert_rows writes the rows
bulk_create writes (every column), model_from_row makes the instance a query makes."""

import pytest
from django.db import connection

from apps.core.db import column_count, insert_rows, model_from_row, select_list
from apps.tasks.models import Task
from apps.tenants.models import ApiKey, Tenant
from apps.tenants.services import issue_platform_key
from tests.factories import OperatorFactory

pytestmark = pytest.mark.django_db

SPEC = {
    "name": "sweep",
    "image": "registry.local/sweep:1",
    "command": ["python", "run.py", "--lr", "0.1"],
    "env": {"LR": "0.1", "TOKEN": {"secret": "hf"}, "EMPTY": ""},
    "volumes": [{"host": "/data", "container": "/data", "read_only": True}],
    "ports": [8000],
    "labels": {"team": "a", "quoted": 'say "hi"'},
    "gpu_required": 2,
    "gpu_memory_mb": 16000,
    "cpu_request": 1.5,
    "priority": 70,
    "timeout_seconds": 600,
    "array_index": 3,
    "array_size": 4,
}
SKIP = {"id", "created_at", "updated_at"}


def columns(task) -> dict:
    row = Task.objects.filter(pk=task.pk).values().get()
    return {name: value for name, value in row.items() if name not in SKIP}


def test_insert_rows_writes_what_bulk_create_writes(world):
    tenant, user = world.tenants["acme"], world.users["acme-member"]
    (ours,) = insert_rows([Task(tenant=tenant, created_by=user, **SPEC)])
    (theirs,) = Task.objects.bulk_create([Task(tenant=tenant, created_by=user, **SPEC)])
    assert ours.pk is not None and ours.pk != theirs.pk
    assert not ours._state.adding and ours._state.db == "default"
    assert columns(ours) == columns(theirs)
    stored = Task.objects.get(pk=ours.pk)
    assert stored.created_at == ours.created_at and stored.env == SPEC["env"]


def test_insert_rows_leaves_many_rows_and_expressions_to_bulk_create(world):
    from django.db.models.functions import Now

    tenant = world.tenants["acme"]
    many = insert_rows([Task(tenant=tenant, name=f"t{i}", image="x") for i in range(25)])
    assert len({task.pk for task in many}) == 25 and all(task.pk for task in many)
    (with_expression,) = insert_rows([Task(tenant=tenant, name="e", image="x", started_at=Now())])
    assert Task.objects.get(pk=with_expression.pk).started_at is not None


def test_model_from_row_is_the_instance_the_orm_reads(world):
    issued = issue_platform_key(user=OperatorFactory(username="rows-op"), name="rows")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {select_list(ApiKey, 'k')}, {select_list(Tenant, 't')} FROM api_keys k "
            "JOIN tenants t ON t.id = %s WHERE k.id = %s",
            [world.tenants["beta"].pk, issued.api_key.pk],
        )
        row = cursor.fetchone()
    api_key = model_from_row(ApiKey, row[: column_count(ApiKey)], "k")
    tenant = model_from_row(Tenant, row[column_count(ApiKey) :], "t")
    orm_key, orm_tenant = ApiKey.objects.get(pk=issued.api_key.pk), Tenant.objects.get(pk=world.tenants["beta"].pk)
    for field in ApiKey._meta.concrete_fields:
        assert getattr(api_key, field.attname) == getattr(orm_key, field.attname), field.name
    for field in Tenant._meta.concrete_fields:
        assert getattr(tenant, field.attname) == getattr(orm_tenant, field.attname), field.name
    assert not api_key._state.adding
