"""A user's actions on a service, in one place for the API's views and the portal's
buttons: who may act (members and admins of its tenant, operators), the scale's bounds
and the states that refuse it, then apps.inference.services. The same words on both."""

from __future__ import annotations

from rest_framework.exceptions import ValidationError

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.inference import services
from apps.inference.choices import ServiceStatus
from apps.inference.models import InferenceService
from apps.tenants import policy

# A sleeping service takes a scale (only its count changes; the wake starts that many); a
# paused one, or one whose window holds its count, would have it overwritten by the
# window's restore, so the user is told instead.
NOT_SCALED = {
    ServiceStatus.STOPPING: "it is stopping",
    ServiceStatus.STOPPED: "it is stopped",
    ServiceStatus.PAUSED: "its scheduling window has paused it",
}


def may_manage(principal, service: InferenceService) -> bool:
    """Scale, stop and wake: as stopping a task (viewers only look)."""
    return policy.may_stop_task(principal, service.group)


def check_may_manage(principal, service: InferenceService) -> None:
    policy.check_may_stop_task(principal, service.group)


def who(principal) -> str:
    return principal.user.username if principal.user is not None else "an API key"


def scale(principal, service: InferenceService, replicas: int) -> bool:
    """Ask for `replicas` replicas, between the service's bounds; True when the count
    changed, False when it already was that. Raises PermissionDenied, ValidationError (out
    of bounds) and Conflict (a state that takes no scale, or a count changed meanwhile)."""
    check_may_manage(principal, service)
    if not service.min_replicas <= replicas <= service.max_replicas:
        raise ValidationError(
            {
                "replicas": [
                    f"Between min_replicas ({service.min_replicas}) and max_replicas ({service.max_replicas}); "
                    "stop it, or let it sleep, to go to zero."
                ]
            }
        )
    why = NOT_SCALED.get(service.state) or (
        "a scheduling window holds its replica count" if service.window_action else None
    )
    if why:
        raise Conflict(f"Service {service.pk} cannot be scaled now: {why}.", CoreErrorCode.INVALID_STATE)
    if replicas == service.replicas:
        return False
    by = who(principal)
    won = services.scale_service(
        service,
        replicas,
        source="user",
        reason=f"scaled by {by} from {service.replicas} to {replicas}",
        details={"by": by},
    )
    if not won:
        raise Conflict(
            f"Service {service.pk}'s replica count changed meanwhile; read it again and retry.",
            CoreErrorCode.STATUS_CHANGED,
        )
    return True


def stop(principal, service: InferenceService):
    check_may_manage(principal, service)
    return services.stop_service(principal, service)


def wake(principal, service: InferenceService):
    check_may_manage(principal, service)
    return services.wake_service(principal, service)
