"""The nodes app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class NodeErrorCode(StrEnum):
    NODE_HAS_ACTIVE_TASKS = "node_has_active_tasks"
    STALE_VERSION = "stale_version"
    SERVICE_MOVE_NOT_APPLICABLE = "service_move_not_applicable"
    NODE_OFFLINE = "node_offline"
    GPU_NOT_LOST = "gpu_not_lost"
    GPU_ALREADY_CORDONED = "gpu_already_cordoned"
    GPU_NOT_CORDONED = "gpu_not_cordoned"
    ALREADY_WATCHED = "already_watched"
    UNSUPPORTED_ARCH = "unsupported_arch"
    NO_AGENT_BUILD = "no_agent_build"
