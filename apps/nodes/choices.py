from django.db import models


class NodeStatus(models.TextChoices):
    ONLINE = "online"
    SUSPECT = "suspect"
    OFFLINE = "offline"
    DEGRADED = "degraded"


# "Alive" for summaries: the node answers, whether or not it can take work.
ALIVE = (NodeStatus.ONLINE, NodeStatus.SUSPECT, NodeStatus.DEGRADED)


class GpuVendor(models.TextChoices):
    NVIDIA = "nvidia"
    AMD = "amd"
    MUSA = "musa", "Moore Threads MUSA"
    HYGON = "hygon", "Hygon DCU"
    CAMBRICON = "cambricon"
    BIREN = "biren"
    ASCEND = "ascend", "Huawei Ascend"
    KUNLUN = "kunlun"
    ILUVATAR = "iluvatar"
    METAX = "metax"
    ENFLAME = "enflame"
    VIRTUAL = "virtual"


class GpuState(models.TextChoices):
    AVAILABLE = "available"
    BUSY = "busy"
    LOST = "lost"
    CORDONED = "cordoned"  # unhealthy or cordoned by an operator: no new placement


class CordonSource(models.TextChoices):
    HEALTH = "health"  # the server's judgement of the card's health readings
    OPERATOR = "operator"
    # the agent reports the card under another index than the row's (its tool renumbered
    # the cards after one dropped out: apps.nodes.card_identity); a task placed on the row
    # would start on the card the agent now has under that index
    RENUMBERED = "renumbered"


class LostBasis(models.TextChoices):
    HEARTBEAT_ABSENT = "heartbeat_absent"
    AGENT_COLLECT_FAILURE = "agent_collect_failure"
    MIXED = "mixed"


class CardIdentity(models.TextChoices):
    """How the heartbeat tells a card apart from its neighbours (apps.nodes.card_identity):
    by its UUID or its PCI address when the agent reports one, else by its index. A card
    of an agent that numbers its cards by position (the tool renumbers them when one drops
    out) and reports neither is known only by its position: when such a card goes missing,
    which one failed cannot be told."""

    UUID = "uuid"
    PCI_BUS_ID = "pci_bus_id", "PCI bus id"
    INDEX = "index"
    POSITION = "position"


class ExecMode(models.TextChoices):
    DOCKER = "docker"
    PROCESS = "process"
    BAREMETAL = "baremetal"
    NONE = "none"


# (the thresholds of the node state machine are settings, used by apps/nodes/liveness.py)
# Lost-GPU judgement: consecutive beats.
LOST_AFTER_BEATS = 3
RECOVERED_AFTER_BEATS = 2

# A node an operator took out of service (drain or maintenance, apps.nodes.services)
# carries this label: the scheduler gives it no new task. Labels merge by key, so the
# agents' beats leave it in place.
CORDON_LABEL = "heteroflow.cordon"


# --- the image channel (docs/images.md) ------------------------------------------------


class ImageAction(models.TextChoices):
    PULL = "pull"
    CHECK = "check"


class ImageRequestStatus(models.TextChoices):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"


IRS = ImageRequestStatus
IMAGE_REQUEST_OPEN = (IRS.PENDING, IRS.PROCESSING)
IMAGE_REQUEST_TRANSITIONS: dict[str, frozenset[str]] = {
    IRS.PENDING: frozenset({IRS.PROCESSING, IRS.FAILED}),
    IRS.PROCESSING: frozenset({IRS.COMPLETED, IRS.FAILED}),
    IRS.COMPLETED: frozenset(),
    IRS.FAILED: frozenset(),
}
IMAGE_PULL_BUDGET_SECONDS = 2 * 3600  # a pull may take this long in all
IMAGE_PROGRESS_SECONDS = 60  # the agent reports a pull's progress this often
IMAGE_STALLED_SECONDS = 600  # judged stalled after this long without progress
IMAGE_CHECK_MAX_REFERENCES = 32


class WatchedImageKind(models.TextChoices):
    ENGINE = "engine", "inference engine"
    BASE = "base", "base image"
    TRAINING = "training", "training image"


# An agent built from a source tree with uncommitted changes marks its commit so
# (apps.nodes.distribution.git_commit); the heartbeat logs it, the nodes page flags it.
DIRTY_BUILD_SUFFIX = "-dirty"


def is_dirty_build(commit: str) -> bool:
    return commit.endswith(DIRTY_BUILD_SUFFIX)
