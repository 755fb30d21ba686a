from heteroflow_agent.runtime.base import LOG_TAIL_LINES, Runtime, RuntimeError_, TaskSpec, TaskState, Volume, task_name

__all__ = ["LOG_TAIL_LINES", "Runtime", "RuntimeError_", "TaskSpec", "TaskState", "Volume", "task_name"]
