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


def uses_world(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.FunctionDef)
        and node.name.startswith("test")
        and "world" in {a.arg for a in node.args.args}
        for node in ast.walk(tree)
    )


def has_transactional_test(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.keyword)
        and node.arg == "transaction"
        and isinstance(node.value, ast.Constant)
        and node.value.value is True
        for node in ast.walk(tree)
    )


def test_no_module_mixes_the_shared_world_with_transactional_tests():
    """`world` (tests/conftest.py) holds one transaction open for its whole module, and a
    module's tests run back to back (pytest-django puts its transactional tests after the
    others, and a worker runs a module at once): a transactional test there would find the
    world's uncommitted rows locked, and the beat or the process it drives would wait on
    them until the test times out."""
    offending = sorted(
        str(path.relative_to(REPO))
        for suite in SUITES
        for path in suite.rglob("test_*.py")
        if (tree := ast.parse(path.read_text(), str(path))) and uses_world(tree) and has_transactional_test(tree)
    )
    assert offending == []
