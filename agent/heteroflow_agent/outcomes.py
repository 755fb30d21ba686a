"""The outcomes the server has not acknowledged yet, kept on disk in the agent's data
directory, so that an agent restart (an upgrade, a crash, a reboot) does not lose a
finished task's result: the next agent process loads them and the reconciler delivers
them at its first pass.

The file is rewritten whole after every change, atomically: a temporary file beside it,
flushed and fsync'ed, renamed over it, and the directory fsync'ed, so a crash at any
moment leaves either the old list or the new one, never half of one. It holds at most
`limit` outcomes with the same field limits as a report (an error message of 10,000
characters, the last 64 KiB of the log), so it stays under about 20 MB. A file that
cannot be read as such a list is set aside (renamed `*.corrupt`), logged, and the agent
starts with what it could read; a single bad entry is skipped and logged.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("heteroflow_agent.outcomes")

FILE_NAME = "undelivered-outcomes.json"
FORMAT = 1
ERROR_MESSAGE_MAX = 10_000
LOG_TAIL_MAX = 64 * 1024
MAX_FILE_BYTES = 64 * 2**20  # far above what `limit` entries can take; a bigger file is not ours
_NONE = type(None)
# field -> the types it may have (bool is refused where an int is wanted)
FIELDS: dict[str, tuple[type, ...]] = {
    "task_id": (int,),
    "from_status": (str,),
    "status": (str,),
    "exit_code": (int, _NONE),
    "error_message": (str,),
    "log_tail": (str,),
    "attempt": (int, _NONE),
}
REQUIRED = ("task_id", "from_status", "status")


def trimmed(outcome: dict) -> dict:
    """What is kept of an outcome: its known fields, cut to what a report sends."""
    kept = {name: outcome.get(name) for name in FIELDS}
    kept["error_message"] = (kept["error_message"] or "")[:ERROR_MESSAGE_MAX]
    kept["log_tail"] = (kept["log_tail"] or "")[-LOG_TAIL_MAX:]
    return kept


def valid(entry) -> bool:
    if not isinstance(entry, dict) or any(name not in entry for name in REQUIRED):
        return False
    for name, types in FIELDS.items():
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, types + ((_NONE,) if name not in REQUIRED else ())):
            return False
    return entry["task_id"] > 0


class OutcomeStore:
    def __init__(self, directory: Path, limit: int):
        self.path = Path(directory) / FILE_NAME
        self.limit = limit
        self._write = threading.Lock()  # one writer at a time, the latest snapshot last

    def load(self) -> list[dict]:
        """The kept outcomes, oldest first (at most `limit`, the newest). A missing file is
        none; an unreadable one is set aside and logged."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        except OSError as exc:
            logger.error("cannot read the kept outcomes in %s: %s", self.path, exc)
            return []
        try:
            if size > MAX_FILE_BYTES:
                raise ValueError(f"{size} bytes, more than the {MAX_FILE_BYTES} such a file can hold")
            document = json.loads(self.path.read_bytes())
            if not isinstance(document, dict) or document.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} outcome list")
            entries = document.get("outcomes")
            if not isinstance(entries, list):
                raise ValueError("no list of outcomes")
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._set_aside(exc)
            return []
        outcomes: dict[int, dict] = {}
        bad = 0
        for entry in entries:
            if valid(entry):
                outcomes.pop(entry["task_id"], None)
                outcomes[entry["task_id"]] = trimmed(entry)
            else:
                bad += 1
        if bad:
            logger.error("%s: %d kept outcome(s) could not be read and are skipped", self.path, bad)
        kept = list(outcomes.values())
        if len(kept) > self.limit:
            logger.error(
                "%s holds %d outcomes, more than %d: the oldest %d are given up",
                self.path,
                len(kept),
                self.limit,
                len(kept) - self.limit,
            )
            kept = kept[-self.limit :]
        return kept

    def save(self, snapshot: Callable[[], list[dict]]) -> bool:
        """Write the list `snapshot()` returns (taken under the writer's lock, so writes
        land in the order of the states they record). False when it could not be
        written: the outcomes are still kept in memory, and the next change tries again."""
        with self._write:
            outcomes = [trimmed(outcome) for outcome in snapshot()][-self.limit :]
            try:
                if outcomes:
                    self._write_atomically({"format": FORMAT, "outcomes": outcomes})
                elif self.path.exists():
                    self.path.unlink()
                    self._sync_directory()
            except OSError as exc:
                logger.error(
                    "cannot keep the undelivered outcomes in %s (%s): an agent restart would lose them", self.path, exc
                )
                return False
        return True

    def _write_atomically(self, document: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps(document, separators=(",", ":")).encode()
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # log tails may be private
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            try:
                temporary.unlink()
            except OSError:
                pass
            raise
        self._sync_directory()

    def _sync_directory(self) -> None:
        """The rename (or removal) itself must survive a power cut, not only the data."""
        try:
            descriptor = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return  # some systems cannot open a directory; the rename is still atomic
        try:
            os.fsync(descriptor)
        except OSError:
            pass
        finally:
            os.close(descriptor)

    def _set_aside(self, problem: Exception) -> None:
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)
            where = f"set aside as {aside}"
        except OSError as exc:
            where = f"could not be set aside ({exc})"
        logger.error(
            "the kept outcomes in %s cannot be read (%s); the file is %s and the agent starts without them",
            self.path,
            problem,
            where,
        )
