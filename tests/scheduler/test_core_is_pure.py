"""The scheduler's core stays pure: its modules (apps/scheduler/core/, and the load rule
and NVLink rules it reads) import the standard library, each other, the pure planning
rules and the choices enums, and nothing of Django's database, the models or the shell.
Parsed, never imported."""

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHEDULER = REPO / "apps" / "scheduler"
PURE = [*sorted((SCHEDULER / "core").glob("*.py")), SCHEDULER / "load.py", SCHEDULER / "nvlink.py"]
ALLOWED_APPS = {"apps.scheduler.load", "apps.scheduler.nvlink", "apps.slices.planning"}


def allowed(module: str) -> bool:
    if module.split(".")[0] in sys.stdlib_module_names:
        return True
    return module in ALLOWED_APPS or module.startswith("apps.scheduler.core") or module.endswith(".choices")


def test_the_core_imports_nothing_impure():
    assert len(PURE) >= 8  # the package's modules are found
    broken = []
    for path in PURE:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from apps.scheduler import nvlink` imports apps.scheduler.nvlink
                names = [node.module if allowed(node.module) else f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            broken += [f"{path.relative_to(REPO)}:{node.lineno} imports {name}" for name in names if not allowed(name)]
    assert broken == []
