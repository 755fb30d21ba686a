"""A waiting task's estimated start in words (hf ps's STARTS column, hf show's line)."""

from datetime import datetime, timezone

from heteroflow_client.cli import start_words

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def estimate(p50, p90, basis="simulated queue"):
    return {"p50": p50, "p90": p90, "computed_at": "2026-12-07T12:00:00+00:00", "basis": basis}


def test_an_estimate_in_words():
    later = estimate("2026-12-07T14:00:00+00:00", "2026-12-07T17:30:00+00:00")
    assert start_words(later, short=True, now=NOW) == "in 2h (p90 5h)"
    assert start_words(later, now=NOW).startswith("in 2h (p90 5h), at 2026-12-07T14:00:00+00:00; simulated queue")
    soon = estimate("2026-12-07T12:00:10+00:00", "2026-12-07T12:00:10+00:00")
    assert start_words(soon, short=True, now=NOW) == "now"


def test_no_estimate_says_why_and_none_yet_says_nothing():
    unknown = estimate(None, None, "waits for a node type that is not in the cluster")
    assert start_words(unknown, short=True, now=NOW) == "?"
    assert start_words(unknown, now=NOW) == "unknown: waits for a node type that is not in the cluster"
    assert start_words(None) is None


def test_hf_resubmit_sends_the_change_as_explain_prints_it(hf, fakeapi):
    from hf_fakeapi import Answer

    new = {"id": 43, "name": "big", "status": "pending"}
    fakeapi.route("POST", "/api/v1/tasks/42/resubmit", lambda r, m: Answer(201, new))
    code, out, _ = hf("resubmit", "42", "gpu_required=4", "affinity=null", "gpu_type=ascend")
    assert code == 0 and "43" in out and "pending" in out
    assert fakeapi.got("POST", "/api/v1/tasks/42/resubmit")[-1].body == {
        "change": {"gpu_required": 4, "affinity": None, "gpu_type": "ascend"}
    }
    code, _, err = hf("resubmit", "42", "gpu_required")
    assert code == 2 and "FIELD=VALUE" in err
    assert len(fakeapi.got("POST", "/api/v1/tasks/42/resubmit")) == 1  # nothing sent
