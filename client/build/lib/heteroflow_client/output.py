"""What `hf` prints: tables (Rich) for people, JSON or YAML (`-o json|yaml`) of the API's
own objects for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Callable

Column = tuple  # (header, getter(item) -> Any)


def raw(value: Any) -> Any:
    """The API's data of a result, a list of results, or plain data."""
    if isinstance(value, list):
        return [raw(item) for item in value]
    if isinstance(value, dict):
        return {key: raw(item) for key, item in value.items()}
    inner = getattr(value, "raw", None)
    return inner if isinstance(inner, dict) else value


def dump(value: Any, fmt: str) -> str:
    data = raw(value)
    if fmt == "json":
        return json.dumps(data, indent=2, default=str, ensure_ascii=False)
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False).rstrip("\n")


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # a pipe gets the whole row, not the 80 columns Rich assumes without a terminal
    return Console(file=stream, width=None if stream.isatty() else 250, highlight=False, soft_wrap=False)


def text(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(text(item) for item in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def table(items: Sequence[Any], columns: Sequence[Column], *, title: str | None = None, empty: str = "") -> None:
    if not items:
        if empty:
            print(empty, file=sys.stderr)
        return
    from rich import box
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, title=title, show_edge=False, pad_edge=False)
    for header, _ in columns:
        grid.add_column(header, overflow="fold")
    for item in items:
        grid.add_row(*(text(getter(item)) for _, getter in columns))
    console().print(grid)


def fields(item: Any, rows: Sequence[Column], *, title: str | None = None) -> None:
    """One object as a two-column table of its fields."""
    from rich import box
    from rich.table import Table

    grid = Table(box=box.SIMPLE, show_header=False, title=title, show_edge=False, pad_edge=False)
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for header, getter in rows:
        grid.add_row(header, text(getter(item)))
    console().print(grid)


def show(value: Any, fmt: str, render: Callable[[], None]) -> None:
    """`render` for a table, else the API's data as JSON or YAML."""
    if fmt == "table":
        render()
    else:
        print(dump(value, fmt))


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def age(value: str | None, now: datetime | None = None) -> str:
    """2026-12-01T10:00:00Z → '5m', '3h', '2d' ago."""
    at = parse_time(value)
    if at is None:
        return "-"
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - at).total_seconds()))
    for size, unit in ((86_400, "d"), (3_600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
