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


class LostBasis(models.TextChoices):
    HEARTBEAT_ABSENT = "heartbeat_absent"
    AGENT_COLLECT_FAILURE = "agent_collect_failure"
    MIXED = "mixed"


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
