"""The errors the SDK raises, and the exit status `hf` gives each.

    HeteroFlowError
    ├── AuthError          no key, or a key the server refuses (401): run `hf login`   exit 2
    ├── ConnectionFailed   the server cannot be reached (its URL and the cause)        exit 2
    ├── ApiError           the API refused the request (4xx, 5xx)                      exit 1
    │   └── NotFound       404: absent, or outside what the key may see                exit 1
    ├── ValidationError    a job file's problem: file, line, column, field             exit 1
    └── TaskFailed         a followed task ended without running (its reason)          exit 1

This module imports nothing outside the standard library: `hf` loads it on every start.
"""

from __future__ import annotations

from typing import Any


class HeteroFlowError(Exception):
    """Every error of the client. `exit_code` is what `hf` exits with."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class AuthError(HeteroFlowError):
    """No API key, or one the server refuses (401)."""

    exit_code = 2


class ConnectionFailed(HeteroFlowError):
    """The server at `url` could not be reached; `cause` says why."""

    exit_code = 2

    def __init__(self, url: str, cause: str):
        super().__init__(f"cannot reach the HeteroFlow server at {url}: {cause}")
        self.url = url
        self.cause = cause


class ApiError(HeteroFlowError):
    """The API answered with an error: `{"error": {"code", "message", "fields"}}`."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        fields: dict[str, Any] | None = None,
        *,
        method: str = "",
        path: str = "",
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.fields = fields or {}
        self.method = method
        self.path = path

    def __str__(self) -> str:
        lines = [f"{self.message} ({self.status} {self.code})"]
        for field, problems in self.fields.items():
            for problem in problems if isinstance(problems, list) else [problems]:
                lines.append(f"  {field}: {_problem_text(problem)}")
        return "\n".join(lines)


def _problem_text(problem: Any) -> str:
    if isinstance(problem, dict):  # a nested serializer's errors
        return "; ".join(f"{key}: {_problem_text(value)}" for key, value in problem.items())
    if isinstance(problem, list):
        return "; ".join(_problem_text(item) for item in problem)
    return str(problem)


class NotFound(ApiError):
    """404: the object does not exist, or is outside what the credentials may see."""


class ValidationError(HeteroFlowError):
    """A problem in a job file, where it is: `file:line:column: field: message`.
    `errors` holds every problem found in the file (this one first); nothing was
    submitted."""

    def __init__(
        self,
        file: str,
        line: int | None,
        column: int | None,
        field: str | None,
        message: str,
        errors: list[ValidationError] | None = None,
    ):
        self.file = file
        self.line = line
        self.column = column
        self.field = field
        self.problem = message
        self.errors = errors if errors is not None else [self]
        super().__init__(self.location_text())

    def location_text(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        field = f"{self.field}: " if self.field else ""
        return f"{where}: {field}{self.problem}"

    def __str__(self) -> str:
        lines = [error.location_text() for error in self.errors]
        count = len(self.errors)
        lines.append(f"{count} problem{'s' if count != 1 else ''} in {self.file}; nothing was submitted.")
        return "\n".join(lines)


class TaskFailed(HeteroFlowError):
    """A followed task ended before it ran (cancelled, or failed to start): `reason`."""

    def __init__(self, task_id: int, status: str, reason: str):
        super().__init__(f"task {task_id} {status} before it started: {reason}")
        self.task_id = task_id
        self.status = status
        self.reason = reason
