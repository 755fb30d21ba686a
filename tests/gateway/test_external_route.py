"""A request through the route to an operator-declared external backend: the tenant
secret as its bearer token, the model listed, metered without a service (and without
GPU-seconds)."""

import openai
import pytest

from apps.confidential.services import put_secret
from apps.gateway.models import ExternalBackend
from tests.gateway.metered import written

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_request_reaches_an_external_backend_with_the_tenants_secret(gateway, upstreams, tenancy):
    put_secret(tenancy.tenant, "upstream-token", "tok-123")
    # written as the service would after its check (a loopback stand-in would be refused)
    ExternalBackend.objects.create(
        tenant=tenancy.tenant, model="gpt-x", base_url=f"{upstreams['c'].url}/v1", secret_name="upstream-token"
    )
    row, key = tenancy.key()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=10)
    answer = client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    assert answer.system_fingerprint == "c"
    path, _, headers = upstreams["c"].app.requests[-1]
    assert path == "/v1/chat/completions" and headers["authorization"] == "Bearer tok-123"
    assert [m.id for m in client.models.list()] == ["gpt-x"]
    (bucket,) = written(gateway, row, 1).buckets
    assert (bucket.model, bucket.service_id, bucket.requests, bucket.prompt_tokens) == ("gpt-x", None, 1, 7)
    assert bucket.gpu_seconds == 0.0  # not a replica of ours: no cards
