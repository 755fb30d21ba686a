"""What every app's admin shares: the operator principal of the signed-in staff user,
and deletes that go through a service (so the admin checks what the API checks)."""

from django.contrib import messages
from django.shortcuts import redirect

from apps.core.errors import Conflict
from apps.core.principals import Principal, PrincipalKind


def operator(request) -> Principal:
    return Principal(PrincipalKind.OPERATOR, user=request.user)


def refusal(exc) -> str:
    """The words of a service's refusal (a 409, a 400 or a 404), as the API gives them."""
    detail = getattr(exc, "detail", exc)
    if isinstance(detail, dict):
        return " ".join(f"{key}: {refusal(value)}" for key, value in detail.items())
    if isinstance(detail, list):
        return " ".join(refusal(item) for item in detail)
    return str(detail)


class DeleteThroughServiceMixin:
    """Deletes one object through its service, `delete_through_service(request, obj)`, which
    each admin defines; a refusal (409) is shown, not swallowed."""

    def delete_view(self, request, object_id, extra_context=None):
        obj = self.get_object(request, object_id)
        if obj is not None and request.method == "POST" and self.has_delete_permission(request, obj):
            try:
                self.delete_through_service(request, obj)
            except Conflict as exc:
                self.message_user(request, str(exc.detail), messages.ERROR)
                return redirect(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", obj.pk)
            self.message_user(request, f"Deleted {obj}.", messages.SUCCESS)
            return redirect(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_changelist")
        return super().delete_view(request, object_id, extra_context)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # a bulk delete would skip the service's checks
        return actions
