from django.db import models


class AlertType(models.TextChoices):
    NODE_OFFLINE = "NODE_OFFLINE"
    GPU_LOST = "GPU_LOST"
    TASK_FAILED = "TASK_FAILED"
    TASK_REQUEUED = "TASK_REQUEUED"
    PREEMPTION_TIMEOUT = "PREEMPTION_TIMEOUT"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    SCHEDULER_STALLED = "SCHEDULER_STALLED"


class Severity(models.TextChoices):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class AlertState(models.TextChoices):
    ACTIVE = "ACTIVE"
    RESOLVED = "RESOLVED"  # by an operator
    RECOVERED = "RECOVERED"  # automatically: the condition went away


class AlertScope(models.TextChoices):
    """What an alert is about; it decides who may see it (apps.alerts.models)."""

    CLUSTER = "cluster"  # the control plane itself (SCHEDULER_STALLED)
    NODE = "node"
    GPU = "gpu"
    TASK = "task"
    TENANT = "tenant"  # QUOTA_EXCEEDED


# seen by the tenant the alert belongs to; the rest are for platform operators only,
# because a node has no owner among the tenants that run on it
TENANT_VISIBLE_SCOPES = (AlertScope.TASK, AlertScope.TENANT)
