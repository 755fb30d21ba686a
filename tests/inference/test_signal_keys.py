"""The gateway's signals for the inference services are spelled in one module
(apps/inference/signal_keys.py): the gateway writes the keys that the autoscaler and the
sleep check read, so a key spelled apart would be a signal never read."""

from apps.gateway import limits
from apps.inference import load_readings, signal_keys
from tests.spelling import spelled


def test_the_keys_keep_their_format():
    assert signal_keys.inflight_key(7) == "hf:svc:7:inflight"
    assert signal_keys.tokens_key(7, 29_000_000) == "hf:svc:7:tokens:29000000"
    assert signal_keys.samples_key(7) == "hf:svc:7:samples"


def test_the_gateway_writes_what_the_autoscaler_reads():
    assert limits.inflight_key(7) == load_readings.inflight_key(7) == signal_keys.inflight_key(7)
    assert limits.tokens_key(7, 12) == load_readings.tokens_key(7, 12) == signal_keys.tokens_key(7, 12)
    # an external backend's counts are the gateway's own, not an inference service's signal
    assert not limits.inflight_key(-3).startswith(signal_keys.SERVICE_PREFIX)
    assert not limits.tokens_key(-3, 12).startswith(signal_keys.SERVICE_PREFIX)


def test_no_other_module_spells_a_signal_key():
    assert spelled(r"hf:svc", home={"apps/inference/signal_keys.py"}) == []
