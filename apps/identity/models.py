"""Who a person is in the company's directory (docs/identity.md).

`GroupMapping`: a directory group (an OpenID Connect `groups` claim value, or an LDAP
group's DN) gives a tenant and a role in it, or makes its people platform operators.
`DirectoryIdentity`: the directory account a user signed in with (the OpenID provider's
`sub`, or the LDAP user name), so that a person is found again by what the directory
says, never by a user name someone could pick."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Lower

from apps.core.models import TenantOwned
from apps.tenants.choices import Role
from apps.tenants.models import Tenant


class GroupMapping(TenantOwned):
    """Read and written by operators only; scoped like every row with a tenant key."""

    group = models.CharField(max_length=500, help_text="An OIDC groups claim value, or an LDAP group DN.")
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="identity_mappings"
    )
    role = models.CharField(max_length=10, choices=Role.choices, blank=True, default="")
    operator = models.BooleanField(default=False, help_text="The group's people are platform operators.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "identity_group_mappings"
        ordering = ["group", "tenant__name"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(operator=False, tenant__isnull=False) & ~models.Q(role=""))
                | models.Q(operator=True, tenant__isnull=True, role=""),
                name="identity_mapping_shape",
            ),
            # a group gives one role per tenant, and operator once (NULLs are distinct:
            # the operator rows get their own constraint)
            models.UniqueConstraint(Lower("group"), "tenant", name="identity_mapping_group_tenant_unique"),
            models.UniqueConstraint(
                Lower("group"), condition=models.Q(operator=True), name="identity_mapping_group_operator_unique"
            ),
        ]

    def __str__(self):
        if self.operator:
            return f"{self.group} → platform operator"
        return f"{self.group} → {self.tenant} ({self.role})"


class DirectoryIdentity(models.Model):
    """One user's account in one directory: `source` is "oidc:<provider>" or "ldap"."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="directory_identities")
    source = models.CharField(max_length=60)
    subject = models.CharField(max_length=255)
    groups = models.JSONField(default=list, blank=True)  # as the last sign-in brought them
    created_at = models.DateTimeField(auto_now_add=True)
    last_sign_in_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "identity_directory_identities"
        ordering = ["source", "subject"]
        constraints = [models.UniqueConstraint(fields=["source", "subject"], name="identity_source_subject_unique")]

    def __str__(self):
        return f"{self.source}:{self.subject} → {self.user}"
