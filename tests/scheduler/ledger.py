"""A check the scheduler's database tests share: the GPU ledger matches the tasks."""

from django.db.models import Sum

from apps.scheduler.models import GpuAllocation
from apps.tasks.choices import HOLDING
from apps.tasks.models import Task


def ledger_agrees():
    held = Task.objects.filter(status__in=HOLDING).aggregate(n=Sum("gpu_required"))["n"] or 0
    whole = GpuAllocation.objects.filter(memory_mb__isnull=True).count()
    return held == whole
