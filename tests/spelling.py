"""Where a rule is spelled: the "one home each" tests (docs/architecture.md) look for a
copy of a rule outside its home module, in the code under apps/ (migrations left out:
they must keep the values they were written with), and name each copy's module and line."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APPS = REPO / "apps"


@cache
def sources() -> tuple[Path, ...]:
    return tuple(sorted(path for path in APPS.rglob("*.py") if "migrations" not in path.parts))


def name_of(path: Path) -> str:
    return str(path.relative_to(REPO))


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def string_literals(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each string in the module's code, the literal parts of f-strings
    included; docstrings and other bare strings (prose, not code) left out."""
    prose = {id(node.value) for node in ast.walk(tree(path)) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node.lineno, node.value


def spelled(pattern: str, *, home: set[str]) -> list[str]:
    """`module:line: text` of each string in the code outside `home` (paths from the
    repository's root) that `pattern` finds."""
    found = re.compile(pattern)
    return [
        f"{name_of(path)}:{line}: {text!r}"
        for path in sources()
        if name_of(path) not in home
        for line, text in string_literals(path)
        if found.search(text)
    ]


def calls(path: Path, name: str) -> Iterator[ast.Call]:
    """Each call of a function or method called `name` in the module."""
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called == name:
                yield node
