"""nvidia-mps: limits through the MPS control daemon's pipe and the client environment.

MPS makes nothing on the card: a client's share is set by the environment it starts
with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), read by the
MPS server the daemon starts for it. So a create checks that the limits can hold: the
card exists (nvidia-smi -L) and the control daemon answers now
(`echo get_server_list | nvidia-cuda-mps-control`, exit 0); it confirms with the card's
UUID as device id and the pipe directory in the handles. A destroy has nothing to undo
on the card; it completes at once.
"""

from __future__ import annotations

import os

from heteroflow_agent.detect.command import find_command, first_line
from heteroflow_agent.detect.mig import parse_listing

from .base import Budget, Outcome, OutOfTime, Vendor, gpu_index, refused

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # CUDA's default when the daemon's env names none
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"


def pipe_directory(configured: str | None = None) -> str:
    return configured or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def log_directory(configured: str | None = None) -> str:
    return configured or os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY


class NvidiaMps(Vendor):
    name = "nvidia-mps"
    tool = "nvidia-smi"

    def __init__(self, root: str = "/", pipe_directory: str | None = None):
        super().__init__(root)
        self.pipe_directory = pipe_directory

    def daemon_answer(self, budget: Budget) -> str:
        """Empty when the control daemon answers, else why not."""
        control = find_command(CONTROL, self.root)
        if not control:
            return f"{CONTROL} is not on this node"
        result = budget.run([control], input="get_server_list\n")
        if result.ok:
            return ""
        said = first_line(result.stderr) or first_line(result.stdout)
        return f"the MPS control daemon does not answer ({said or result.describe()})"

    def create(self, params: dict, budget: Budget) -> Outcome:
        index = gpu_index(params)
        if index is None:
            return refused(f"gpu_index {params.get('gpu_index')!r} is not a card index")
        path = self.path()
        if not path:
            return refused("nvidia-smi is not on this node")
        try:
            listed = budget.run([path, "-L"])
            if not listed.ok:
                return Outcome(False, f"cannot list the cards: {listed.describe()}")
            cards = parse_listing(listed.stdout)
            if index not in cards:
                return refused(f"this node has no GPU {index}")
            uuid = cards[index]["uuid"]
            if params.get("gpu_uuid") and params["gpu_uuid"] != uuid:
                return refused(f"GPU {index} is {uuid}, not {params['gpu_uuid']}")
            memory = params.get("memory_mb")
            percent = params.get("compute_percent")
            if not isinstance(memory, int) or memory <= 0:
                return refused(f"memory_mb {memory!r} is not a limit")
            if not isinstance(percent, int) or not 1 <= percent <= 100:
                return refused(f"compute_percent {percent!r} is not a share (1-100)")
            why = self.daemon_answer(budget)
        except OutOfTime as exc:
            return Outcome(False, str(exc))
        if why:
            return Outcome(False, why)
        return Outcome(
            True,
            device_id=uuid,
            handles={
                "pipe_directory": pipe_directory(self.pipe_directory),
                "active_thread_percentage": percent,
                "pinned_device_mem_limit": f"0={memory}M",
            },
        )

    def destroy(self, params: dict, budget: Budget) -> Outcome:
        return Outcome(True)  # the limits lived in the client's environment; nothing on the card
