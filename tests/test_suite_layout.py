"""The suite's own layout: a test module imports helpers from plain modules (factories,
headers, payloads…), never from another test module or a conftest, so moving or
deleting one test file never breaks another."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITES = [REPO / "tests", REPO / "agent" / "tests"]


def is_test_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_test_module_imports_another_test_module_or_a_conftest():
    offending = sorted(
        f"{path.relative_to(REPO)}: {module}"
        for suite in SUITES
        for path in suite.rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] in ("tests", "agent") and is_test_module(module)
    )
    assert offending == []
