from celery import shared_task
from django.contrib.sessions.models import Session

from apps.core.clock import utcnow
from apps.core.guard import run_periodic


def purge_expired_sessions() -> int:
    deleted, _ = Session.objects.filter(expire_date__lt=utcnow()).delete()
    return deleted


@shared_task(name="core.purge_expired_sessions")
def purge_expired_sessions_job() -> str:
    return run_periodic("core.purge_expired_sessions", purge_expired_sessions).outcome
