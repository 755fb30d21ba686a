"""Slicing capability bits: what the server may offer on each card.

The rule is "report less rather than claim too much": MIG only when nvidia-smi (or
NVML) says the mode is Enabled now, MPS only while the control daemon is alive now, so
a daemon that dies is dropped on the next beat. A node inside a container does no
hardware slicing at all and offers software accounting only.

Tiers, from the spec (1-9, smaller is stronger): 1 MIG (hardware isolation), 2 MPS or
a HAMi vDCU (shared with limits), 9 software accounting only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

TIER_MIG = 1
TIER_MPS = 2
TIER_SOFTWARE = 9

MPS_CONTROL = "nvidia-cuda-mps-control"
_CONTAINER_CGROUP = re.compile(r"docker|kubepods|containerd|libpod|podman|lxc|garden", re.IGNORECASE)


def is_container(root: str = "/") -> bool:
    """Whether this agent runs inside a container (Docker, Podman, Kubernetes, LXC)."""
    for marker in (".dockerenv", "run/.containerenv"):
        if os.path.exists(os.path.join(root, marker)):
            return True
    try:
        with open(os.path.join(root, "proc/1/cgroup"), encoding="utf-8", errors="replace") as fh:
            return bool(_CONTAINER_CGROUP.search(fh.read()))
    except OSError:
        return False


def mps_daemon_alive(root: str = "/") -> bool:
    """Whether an MPS control daemon is running now, read from /proc.

    The kernel cuts a process name to 15 characters, which makes the control daemon
    and the MPS server both "nvidia-cuda-mps"; argv[0] tells them apart. A zombie has an
    empty command line and does not count.
    """
    proc = os.path.join(root, "proc")
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "comm"), encoding="utf-8", errors="replace") as fh:
                comm = fh.read().strip()
            if not comm.startswith("nvidia-cuda-mps"):
                continue
            with open(os.path.join(proc, pid, "cmdline"), "rb") as fh:
                argv0 = fh.read().split(b"\0", 1)[0].decode("utf-8", "replace")
        except OSError:
            continue  # gone between listdir and open
        if os.path.basename(argv0) == MPS_CONTROL:
            return True
    return False


def capabilities(
    cards: Iterable[tuple[int, str]],
    *,
    nvidia: bool,
    mig: dict[str, bool],
    mps_alive: bool,
    container: bool,
    mig_instances: dict[str, list[dict]] | None = None,
    hami: dict[int, bool] | None = None,
) -> dict[str, dict]:
    """gpu_capabilities for (index, uuid) cards, keyed by the index as a string.

    `mig_instances` (card uuid -> its MIG instances) is added for a MIG card whose
    listing worked ([] = none there); `hami` (card index -> the vDCU tool carves it) is
    given for Hygon cards only, and says `hami_capable` for each (tier 2: shared with
    limits, like MPS). Absent keys mean "not known"."""
    hardware = nvidia and not container
    result: dict[str, dict] = {}
    for index, uuid in cards:
        mig_capable = hardware and bool(uuid) and mig.get(uuid, False)
        mps_capable = hardware and mps_alive
        hami_capable = hami is not None and not container and bool(hami.get(index))
        tier = TIER_MIG if mig_capable else TIER_MPS if mps_capable or hami_capable else TIER_SOFTWARE
        entry = {"mig_capable": mig_capable, "mps_capable": mps_capable, "best_tier": tier}
        if hami is not None:
            entry["hami_capable"] = hami_capable
        if mig_capable and mig_instances is not None and uuid in mig_instances:
            entry["mig_instances"] = [dict(instance) for instance in mig_instances[uuid]][:64]
        result[str(index)] = entry
    return result
