from django.db import models


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}


def role_at_least(role: str | None, minimum: str) -> bool:
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[Role(minimum)]


class KeyScope(models.TextChoices):
    TENANT = "tenant", "Tenant key (sk-tenant-)"
    PLATFORM = "platform", "Platform operator key (sk-admin-)"


KEY_PREFIX = {KeyScope.TENANT: "sk-tenant-", KeyScope.PLATFORM: "sk-admin-"}
