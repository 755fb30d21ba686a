"""The slices' vocabularies: the tiers a card can be carved with, the slice's states, and
the command channel's actions, vendors and request states (docs/slices.md)."""

from django.db import models


class Tier(models.TextChoices):
    """How a slice is enforced. Derived from the card the task lands on, never chosen by
    the user (apps.slices.planning.tier_for)."""

    MIG = "mig", "MIG (hardware partition)"
    MPS = "mps", "MPS (per-client limits)"
    HAMI = "hami", "HAMi (cgroup limits, Hygon DCU)"
    SOFTWARE = "software", "software accounting only"


class Qos(models.TextChoices):
    GOLD = "gold"
    SILVER = "silver"
    BRONZE = "bronze"


QOS_OF_TIER = {Tier.MIG: Qos.GOLD, Tier.MPS: Qos.SILVER, Tier.HAMI: Qos.SILVER, Tier.SOFTWARE: Qos.BRONZE}


class SliceState(models.TextChoices):
    REQUESTED = "requested"  # written at bind; a create request waits for the agent
    ISSUED = "issued"  # the agent claimed the create request
    CONFIRMED = "confirmed"  # the agent made it (device_id set); the task may start
    RELEASING = "releasing"  # the task ended; a destroy request waits for the agent
    RELEASED = "released"
    FAILED = "failed"  # the create failed or timed out; nothing of it is on the card
    ORPHANED = "orphaned"  # on the card with no live task (GC'd with a destroy request)


SL = SliceState
# Slices serving their task (at most one per task: a requeued task's next bind carves anew).
HOLDING = (SL.REQUESTED, SL.ISSUED, SL.CONFIRMED)
# Slices that still occupy (or may occupy) the card: planning and the GC count them all,
# since a MIG instance being destroyed still takes its place until the agent reports.
LIVE = (*HOLDING, SL.RELEASING, SL.ORPHANED)
ENDED = (SL.RELEASED, SL.FAILED)


class SliceAction(models.TextChoices):
    CREATE = "create"
    DESTROY = "destroy"


class SliceVendor(models.TextChoices):
    """The agent's executors (agent/heteroflow_agent/channels/slices.py)."""

    NVIDIA_MIG = "nvidia-mig"
    NVIDIA_MPS = "nvidia-mps"
    HYGON_HAMI = "hygon-hami"


VENDOR_OF_TIER = {Tier.MIG: SliceVendor.NVIDIA_MIG, Tier.MPS: SliceVendor.NVIDIA_MPS, Tier.HAMI: SliceVendor.HYGON_HAMI}


class RequestStatus(models.TextChoices):
    PENDING = "pending"
    PROCESSING = "processing"  # claimed by the agent (deadline: claimed_at + 2 min)
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"  # claimed and not reported in time (judged by the compensation scan)


RS = RequestStatus
REQUEST_OPEN = (RS.PENDING, RS.PROCESSING)
REQUEST_TERMINAL = (RS.COMPLETED, RS.FAILED, RS.TIMED_OUT)
REQUEST_TRANSITIONS: dict[str, frozenset[str]] = {
    RS.PENDING: frozenset({RS.PROCESSING, RS.FAILED}),
    RS.PROCESSING: frozenset({RS.COMPLETED, RS.FAILED, RS.TIMED_OUT}),
    RS.COMPLETED: frozenset(),
    RS.FAILED: frozenset(),
    RS.TIMED_OUT: frozenset(),
}

POLL_LIMIT = 5  # requests handed out per poll
REQUEST_SECONDS = 120  # a claimed request must be reported within this
