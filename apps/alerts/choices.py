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
