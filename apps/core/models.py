from django.db import models

from apps.core.scoping import ScopedQuerySet


class TenantOwned(models.Model):
    """A row of a shared table that belongs to a tenant (its `tenant` foreign key). Its
    default manager is scoped, so `Model.objects.visible_to(principal)` is there for every
    such table (docs/architecture.md, Tenancy; NetBox narrows its querysets in one base
    model the same way). A model whose scope needs more than its tenant's key declares
    its own ScopedQuerySet subclass as `objects`. The fields stay on each model: only the
    manager is shared, and a manager without use_in_migrations changes no migration."""

    objects = ScopedQuerySet.as_manager()

    class Meta:
        abstract = True


class JobRun(models.Model):
    """The last run of one periodic job, shared by every beat, worker and instance."""

    key = models.CharField(max_length=100, primary_key=True)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_outcome = models.CharField(max_length=20, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    runs = models.PositiveBigIntegerField(default=0)
    # How long the job's work took, summed and at most, over the runs that ran it (RAN or
    # FAILED): the mean against the period says whether a job keeps up (make bench).
    total_seconds = models.FloatField(default=0.0, db_default=0.0)
    max_seconds = models.FloatField(default=0.0, db_default=0.0)

    class Meta:
        db_table = "job_runs"

    def __str__(self):
        return self.key


class OperatorAuditEvent(models.Model):
    """A change an operator made (any tenant's, or the platform's: nodes, plugins,
    tenants, watched images…), kept in `public` so that operators read one log. A change
    in one tenant is in that tenant's own log as well (apps.confidential AuditEvent, in
    its schema), which its admins read. The actor and the tenant are kept by name, so the
    record survives them."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=200)
    target = models.CharField(max_length=200, blank=True, default="")
    tenant = models.CharField(max_length=63, blank=True, default="", help_text="Its slug; empty: the platform.")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "operator_audit_events"
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["tenant", "-at"], name="operator_audit_tenant_at")]

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
