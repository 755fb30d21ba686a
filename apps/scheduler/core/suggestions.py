"""What would start a waiting task or group now (docs/predictions.md#suggestions): the
smallest change of each kind that the real placement accepts on the snapshot, tried on a
copy of it. Pure: the caller passes `places`, the real placement bound to its snapshot;
no rule is written here a second time.

The kinds, each tried from the smallest change up and given once at most:
- fewer cards: the most cards that fit (a power of two per worker for a group);
- another GPU type: each type in the snapshot that takes it, as it is otherwise;
- less memory per card: the most memory that fits, in steps of MEMORY_STEP_MB;
- a hard constraint dropped: a `<plugin>: required` label, one affinity or anti-affinity
  label, or a runtime other than auto."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from apps.scheduler.core.groups import GroupReq
from apps.scheduler.core.snapshot import NodeSnap, TaskReq
from apps.tasks.choices import TaskRuntime

MEMORY_STEP_MB = 256
TYPES_SHOWN = 3

Work = TaskReq | GroupReq


@dataclass(frozen=True)
class Suggestion:
    change: dict  # the submission fields to change, as the API takes them
    why: str


def suggest(work: Work, nodes: Iterable[NodeSnap], places: Callable[[Work], bool]) -> list[Suggestion]:
    """Every kind's smallest change that `places` accepts, in the order of the kinds."""
    found: list[Suggestion] = []
    for kind in (fewer_cards, other_types, less_memory, constraints_dropped):
        found.extend(kind(work, nodes, places))
    return found


def largest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [low, high] with fits(n), for a `fits` that holds below any n it
    holds for (fewer cards or less memory never fit worse); None when none does."""
    if high < low or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def fewer_cards(work: Work, nodes, places) -> Iterator[Suggestion]:
    if isinstance(work, GroupReq):
        # per worker, halving: a distributed job keeps a power of two
        per_worker = work.gpus_per_worker // 2
        while per_worker >= 1:
            if places(replace(work, gpus_per_worker=per_worker)):
                yield Suggestion(
                    {"gpus_per_worker": per_worker},
                    f"{per_worker} cards per worker instead of {work.gpus_per_worker} fit now",
                )
                return
            per_worker //= 2
        return
    if work.gpu_required < 2:
        return
    most = largest(1, work.gpu_required - 1, lambda count: places(replace(work, gpu_required=count)))
    if most is not None:
        yield Suggestion({"gpu_required": most}, f"{most} cards instead of {work.gpu_required} fit on one node now")


def other_types(work: Work, nodes, places) -> Iterator[Suggestion]:
    present = sorted({gpu.vendor.lower() for node in nodes for gpu in node.gpus} - {work.gpu_type.lower()})
    shown = 0
    for gpu_type in present:
        if shown == TYPES_SHOWN:
            return
        if places(replace(work, gpu_type=gpu_type)):
            shown += 1
            yield Suggestion({"gpu_type": gpu_type}, f"{gpu_type} cards are free for it now")


def less_memory(work: Work, nodes, places) -> Iterator[Suggestion]:
    if isinstance(work, GroupReq) or not work.gpu_memory_mb or work.gpu_memory_mb <= MEMORY_STEP_MB:
        return
    steps = (work.gpu_memory_mb - 1) // MEMORY_STEP_MB
    most = largest(1, steps, lambda step: places(replace(work, gpu_memory_mb=step * MEMORY_STEP_MB)))
    if most is not None:
        memory = most * MEMORY_STEP_MB
        yield Suggestion({"gpu_memory_mb": memory}, f"{memory} MB per card instead of {work.gpu_memory_mb} MB fits now")


def constraints_dropped(work: Work, nodes, places) -> Iterator[Suggestion]:
    for label, value in sorted(work.labels.items()):
        if str(value).lower() == "required":
            rest = {key: kept for key, kept in work.labels.items() if key != label}
            if places(replace(work, labels=rest)):
                yield Suggestion({"labels": rest}, f"without `{label}: required` it fits now")
    for label in sorted(work.affinity_labels):
        rest = {key: kept for key, kept in work.affinity_labels.items() if key != label}
        if places(replace(work, affinity_labels=rest)):
            yield Suggestion(
                {"affinity": {"nodes_with_labels": rest} if rest else None},
                f"without the affinity label `{label}` it fits now",
            )
    for label in sorted(work.anti_affinity_labels):
        rest = {key: kept for key, kept in work.anti_affinity_labels.items() if key != label}
        if places(replace(work, anti_affinity_labels=rest)):
            yield Suggestion(
                {"anti_affinity": {"labels": rest} if rest else None},
                f"without the anti-affinity label `{label}` it fits now",
            )
    if work.runtime != TaskRuntime.AUTO and places(replace(work, runtime=TaskRuntime.AUTO)):
        yield Suggestion({"runtime": TaskRuntime.AUTO.value}, f"with any runtime, not only {work.runtime}, it fits now")
