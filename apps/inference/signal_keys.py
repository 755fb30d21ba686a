"""The Redis keys of the gateway's signals for the inference services, spelled once for
both sides: the gateway writes them (apps.gateway.limits) and the autoscaler and the
sleep check read them (apps.inference.load_readings). A key spelled two ways would be a signal
written and never read, which the autoscaler takes for no reading at all.

- `hf:svc:{service_id}:inflight`: requests in flight, queued ones included;
- `hf:svc:{service_id}:tokens:{unix_minute}`: completion tokens that minute;
- `hf:svc:{service_id}:samples`: the autoscaler's own series of its samples.
"""

from __future__ import annotations

SERVICE_PREFIX = "hf:svc:"


def inflight_key(service_id: int) -> str:
    return f"{SERVICE_PREFIX}{service_id}:inflight"


def tokens_key(service_id: int, unix_minute: int) -> str:
    return f"{SERVICE_PREFIX}{service_id}:tokens:{unix_minute}"


def samples_key(service_id: int) -> str:
    return f"{SERVICE_PREFIX}{service_id}:samples"
