from django.db import models


class AlertType(models.TextChoices):
    NODE_OFFLINE = "NODE_OFFLINE"
    GPU_LOST = "GPU_LOST"
    TASK_FAILED = "TASK_FAILED"
    TASK_REQUEUED = "TASK_REQUEUED"
    PREEMPTION_TIMEOUT = "PREEMPTION_TIMEOUT"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    SCHEDULER_STALLED = "SCHEDULER_STALLED"
    GPU_UNHEALTHY = "GPU_UNHEALTHY"  # a card cordoned on its health readings (apps.nodes.health)
    GPU_MEMORY_DRIFT = "GPU_MEMORY_DRIFT"  # measured use the ledger does not explain (apps.nodes.drift)
    GATEWAY_REDIS_AWAY = "GATEWAY_REDIS_AWAY"  # the gateway holds its limits per process, refuses, or has none
    GPU_DRIVER_ERROR = "GPU_DRIVER_ERROR"  # a node's GPU collector fails as a whole: degraded (apps.alerts.failures)
    INTERACTIVE_IDLE = "INTERACTIVE_IDLE"  # an interactive task is about to be stopped for idling (apps.tunnel.idle)


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


# --- notification channels (apps.alerts.notifications) ----------------------------------

SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}


class ChannelKind(models.TextChoices):
    WEBHOOK = "webhook"
    EMAIL = "email"


class NotificationEvent(models.TextChoices):
    RAISED = "alert.raised"  # a new ACTIVE alert
    ENDED = "alert.ended"  # the alert became RESOLVED or RECOVERED
    TEST = "test"  # asked for through the API, to try the channel


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # waiting for its first attempt or for a retry
    DELIVERED = "delivered"
    FAILED = "failed"  # permanently: a refusal, or every attempt used
    CANCELLED = "cancelled"  # its channel was disabled before it went out
