"""Tables that live in each tenant's own schema (TENANT_APPS): what is confidential to one
tenant never sits in `public`. Read and write them only inside `schema_context(...)`."""

from django.db import models


class Secret(models.Model):
    """A value a task references by name (registry credentials, tokens). Resolved into the
    agent's payload at hand-out time; never copied into `public`."""

    name = models.CharField(max_length=100, unique=True)
    value = models.TextField()
    description = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "secrets"
        ordering = ["name"]

    def __str__(self):
        return self.name


class AuditEvent(models.Model):
    """What happened in this tenant and who did it. Actors are stored by name, not by
    foreign key, so the record survives the user."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=60)
    target = models.CharField(max_length=200, blank=True, default="")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "audit_events"
        ordering = ["-at", "-id"]

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"


class ChannelCredentials(models.Model):
    """A webhook notification channel's credentials: its URL (a chat webhook's URL often
    carries a token of its own) and the secret its deliveries are signed with, keyed by
    the channel's id (apps.alerts NotificationChannel, in `public`)."""

    channel_id = models.BigIntegerField(unique=True)
    url = models.TextField()
    secret = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    def __str__(self):
        return f"channel {self.channel_id}"


class ChannelSecret(ChannelCredentials):
    """A tenant's channels' credentials, in the tenant's schema. (The operators' channels
    belong to no tenant: theirs are apps.alerts OperatorChannelSecret, in `public`.)"""

    class Meta:
        db_table = "channel_secrets"
