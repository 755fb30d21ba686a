from rest_framework.permissions import BasePermission


def _principal(request):
    return getattr(request, "auth", None)


class IsPersonOrPersonKey(BasePermission):
    """The default: operators and tenant principals. The agent key reaches agent endpoints only."""

    message = "These credentials cannot use this endpoint."

    def has_permission(self, request, view):
        principal = _principal(request)
        return principal is not None and (principal.is_operator or principal.is_tenant)


class IsOperator(BasePermission):
    message = "Only platform operators can do this."

    def has_permission(self, request, view):
        principal = _principal(request)
        return principal is not None and principal.is_operator


class IsAgent(BasePermission):
    message = "Only node agents can use this endpoint."

    def has_permission(self, request, view):
        principal = _principal(request)
        return principal is not None and principal.is_agent
