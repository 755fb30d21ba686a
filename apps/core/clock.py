"""The time source. Code that depends on time takes `now` as a parameter and falls back
to this, so tests can pass a clock instead of sleeping."""

from datetime import datetime

from django.utils import timezone


def utcnow() -> datetime:
    return timezone.now()
