"""Small parsing helpers shared by the vendor readers.

Vendor tools write "not available" in many ways ("N/A", "[N/A]", "[Not Supported]",
"-", "NA", "Unknown"); all of them become None here, so a field the tool did not give
is left out of the heartbeat instead of turning into 0.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NO_DEVICES = re.compile(
    r"no (?:\w+ )?(?:devices?|gpus?|cards?|npus?|mlus?|dcus?|xpus?|gcus?)"
    r"(?: (?:were|was|are|is))? (?:found|detected|available)",
    re.IGNORECASE,
)
# Markers nvidia-smi (and its clones) print in place of a value when the card itself
# has failed, as opposed to a field the card simply does not support.
CARD_ERROR = re.compile(r"\[(?:unknown error|gpu is lost|gpu lost|gpu requires reset)\]", re.IGNORECASE)

_UNIT_TO_MIB = {
    "b": 1.0 / (1024 * 1024),
    "kb": 1.0 / 1024,
    "kib": 1.0 / 1024,
    "mb": 1.0,
    "mib": 1.0,
    "gb": 1024.0,
    "gib": 1024.0,
}


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text or "")


def number(value) -> float | None:
    """The leading number of `value` ("45.0C", "0 %", "118.0W"), or None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    match = _NUMBER.match(str(value))
    return float(match.group(1)) if match else None


def integer(value) -> int | None:
    n = number(value)
    return int(n) if n is not None else None


def to_mib(value, unit: str = "MiB") -> int | None:
    """A memory amount in MiB. The unit may be inside `value` ("16384 MiB", "17163091968 B")."""
    n = number(value)
    if n is None:
        return None
    text = str(value)
    match = re.search(r"([KMG]i?B|B)\b", text, re.IGNORECASE)
    if match and not isinstance(value, (int, float)):
        unit = match.group(1)
    factor = _UNIT_TO_MIB.get(unit.lower())
    if factor is None:
        return None
    return int(round(n * factor))


def says_no_devices(*texts: str) -> bool:
    return any(_NO_DEVICES.search(t or "") for t in texts)


def extract_json(text: str):
    """The JSON document inside `text`, tolerating banner lines around it (hy-smi prints
    some), or None."""
    text = text or ""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None
    start = min(starts)
    closer = "}" if text[start] == "{" else "]"
    end = text.rfind(closer)
    if end <= start:
        return None
    try:
        return json.loads(text[start : end + 1])
    except ValueError:
        return None


_KV = re.compile(r"^(\s*)(\S.*?)\s*:\s(.*)$|^(\s*)(\S.*?)\s*:$")


def sectioned_records(text: str, start: re.Pattern) -> list[tuple[re.Match, dict[str, str]]]:
    """Split "Key : Value" reports (nvidia-smi -q, cnmon info, efsmi -q) into one record
    per card.

    A line matching `start` opens a card. Inside it, a line without " : " is a section
    heading and the indentation below it nests; each value is stored under its
    lower-case path, e.g. "physical memory usage/used". The first value wins when a
    path repeats.
    """
    records: list[tuple[re.Match, dict[str, str]]] = []
    current: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for raw in (text or "").splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        opened = start.match(line)
        if opened:
            current = {}
            records.append((opened, current))
            stack = []
            continue
        if current is None:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        match = _KV.match(line)
        if match and match.group(2) is not None:
            key, value = match.group(2), match.group(3).strip()
        elif match:
            key, value = match.group(5), ""
        else:
            stack.append((indent, line.strip().lower()))
            continue
        path = "/".join([name for _, name in stack] + [key.strip().lower()])
        current.setdefault(path, value)
    return records


def lookup(record: dict[str, str], *patterns: str) -> str | None:
    """The first value whose path matches one of `patterns` (regexes, tried in order)."""
    for pattern in patterns:
        regex = re.compile(pattern)
        for path, value in record.items():
            if regex.search(path):
                return value
    return None


def pipe_cells(line: str) -> list[str]:
    """The cells of a "| a | b | c |" table row."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|"):
        body = body[:-1]
    return [cell.strip() for cell in body.split("|")]


BUS_ID = re.compile(r"^[0-9A-Fa-f]{2,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_BUS_IN_TEXT = re.compile(
    r"(?<![0-9A-Za-z:])(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])(?![0-9A-Za-z])"
)


def pci_bus_id(text) -> str:
    """The first PCI address in `text`, written one way whatever the tool's width:
    "0000:3f:00.0" (domain of four hex digits, lower case). Tools print "00000000:3f:00.0"
    (nvidia-smi's clones), "0000:0f:00.0", "00:2e:00.0" (efsmi's two-digit domain), or the
    address inside more text ("0000:05:00.0 --> SN: ... --> OAM ID: 1", hy-smi). "" when
    there is none ("N/A"), or the domain does not fit four digits."""
    match = _BUS_IN_TEXT.search(str(text or ""))
    if not match:
        return ""
    domain = int(match.group(1) or "0", 16)
    if domain > 0xFFFF:
        return ""
    return f"{domain:04x}:{match.group(2).lower()}:{match.group(3).lower()}.{match.group(4)}"
