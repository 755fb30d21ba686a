"""What the gateway's meter wrote for a key, waited for: a request reaches the meter only
after its answer has gone, so a test that reads the usage right after its call can run
ahead of it."""

from types import SimpleNamespace

from apps.gateway.models import UsageBucket
from tests.live import wait_until


def written(gateway, row, requests: int, **where) -> SimpleNamespace:
    """The key's usage once `requests` requests are in it (flushed from the gateway's
    meter): requests, errors, tokens and GPU-seconds summed over its buckets (two if the
    minute turned meanwhile), and the buckets themselves."""

    def flushed():
        gateway.call(gateway.app.meter.flush())
        buckets = list(UsageBucket.objects.filter(key=row, **where))
        return buckets if sum(b.requests for b in buckets) >= requests else None

    buckets = wait_until(flushed, 10, f"{requests} requests in the usage")
    fields = ("requests", "errors", "prompt_tokens", "completion_tokens", "gpu_seconds")
    return SimpleNamespace(buckets=buckets, **{f: sum(getattr(b, f) for b in buckets) for f in fields})
