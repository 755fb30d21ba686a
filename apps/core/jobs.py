from django.contrib.sessions.models import Session

from apps.core.clock import utcnow
from apps.core.guard import periodic_job


def purge_expired_sessions() -> int:
    deleted, _ = Session.objects.filter(expire_date__lt=utcnow()).delete()
    return deleted


purge_expired_sessions_job = periodic_job("core.purge_expired_sessions", every=3600)(purge_expired_sessions)
