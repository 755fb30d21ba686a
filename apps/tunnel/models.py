"""The tunnel's tables: each node's pinned host key, and the audit of every session."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.core.models import TenantOwned
from apps.tunnel.choices import SessionKind, SessionOutcome


class TunnelHostKey(models.Model):
    """A node's tunnel host key, pinned the first time the node registered it (trust on
    first use, through the agent-key-authenticated API). A node offering another key is
    refused until an operator deletes this row (admin: "forget the key")."""

    node = models.OneToOneField(
        "nodes.Node", primary_key=True, on_delete=models.CASCADE, related_name="tunnel_key", db_column="node_id"
    )
    public_key = models.TextField(help_text="OpenSSH form: ssh-ed25519 AAAA…")
    fingerprint = models.CharField(max_length=100, unique=True)
    pinned_at = models.DateTimeField()
    last_connected_at = models.DateTimeField(null=True, blank=True)
    last_instance = models.CharField(
        max_length=200, blank=True, default="", help_text="the tunnel process it last used"
    )

    class Meta:
        db_table = "tunnel_host_keys"

    def __str__(self) -> str:
        return f"{self.node_id}: {self.fingerprint}"


class TunnelSession(TenantOwned):
    """One way into a task: who, which task, which port or command, when, how many bytes
    each way, and how it ended. Written by the tunnel process (apps.tunnel.audit)."""

    task_id = models.BigIntegerField(db_index=True)
    node_id = models.CharField(max_length=128)
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    principal = models.CharField(max_length=300, help_text="who, in words (user, role, key)")
    kind = models.CharField(max_length=10, choices=SessionKind.choices)
    port = models.PositiveIntegerField(null=True, blank=True)
    command = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    bytes_in = models.BigIntegerField(default=0, help_text="from the user to the task")
    bytes_out = models.BigIntegerField(default=0, help_text="from the task to the user")
    outcome = models.CharField(max_length=20, choices=SessionOutcome.choices, default=SessionOutcome.OPEN)
    reason = models.TextField(blank=True, default="")
    instance = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "tunnel_sessions"
        ordering = ("-started_at",)

    def __str__(self) -> str:
        return f"{self.kind} task {self.task_id} by {self.principal}"
