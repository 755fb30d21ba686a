"""Deleting a model that services may name: the one delete_model, which the API's DELETE,
the portal's delete and the admin call.

A service holds its model (the foreign key is PROTECT): a model that a service not yet
stopped uses is refused with 409 `model_in_use`, naming those services, and nothing is
deleted. The records of services already stopped (a stopped service takes nothing more:
stop is one-way) go with the model, their decisions too; their task groups and tasks stay,
as the tasks' history. The check and the deletion hold the model's row locked, so a
service created at the same moment either is seen by the check or fails its insert (its
foreign key finds no model), never leaving a service without its model."""

from __future__ import annotations

from django.db import transaction
from django.db.models.deletion import ProtectedError, RestrictedError

from apps.core.errors import Conflict
from apps.inference.choices import ServiceStatus
from apps.inference.error_codes import InferenceErrorCode
from apps.inference.models import InferenceService, Model
from apps.tenants import policy

MAX_NAMED = 20


def services_using(model: Model) -> list[InferenceService]:
    """The services not stopped that name `model`, by name."""
    return list(
        InferenceService.objects.filter(model=model)
        .exclude(state=ServiceStatus.STOPPED)
        .select_related("group")
        .order_by("group__name", "group_id")
    )


def in_use(model: Model, using: list[InferenceService]) -> Conflict:
    named = ", ".join(f"'{s.group.name}' (#{s.group_id}, {s.state})" for s in using[:MAX_NAMED])
    more = f" and {len(using) - MAX_NAMED} more" if len(using) > MAX_NAMED else ""
    return Conflict(
        f"Model '{model.name}' is used by {len(using)} service{'s' if len(using) != 1 else ''}: {named}{more}. "
        "Stop them first; a stopped service does not hold its model.",
        InferenceErrorCode.MODEL_IN_USE,
    )


def delete_model(principal, model: Model) -> list[int]:
    """Delete `model` after the pre-check (above); the ids of the stopped services whose
    records went with it. Raises PermissionDenied (viewers; the policy is asked here, once)
    and Conflict (in use)."""
    policy.check_may_manage_models(principal, model.tenant)
    with transaction.atomic():
        locked = Model.objects.select_for_update().filter(pk=model.pk).first()
        if locked is None:  # deleted meanwhile: what was asked is done
            return []
        using = services_using(locked)
        if using:
            raise in_use(locked, using)
        stopped = list(
            InferenceService.objects.filter(model=locked, state=ServiceStatus.STOPPED).values_list("pk", flat=True)
        )
        InferenceService.objects.filter(pk__in=stopped).delete()
        try:
            Model.objects.filter(pk=locked.pk).delete()
        except (ProtectedError, RestrictedError):  # cannot happen under the lock; never a 500 if it does
            raise in_use(locked, services_using(locked)) from None
    return stopped
