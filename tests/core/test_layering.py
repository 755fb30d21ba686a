"""The apps import each other one way, in the order docs/architecture.md writes down.

The layer table is read from the document itself (the one place it is written); every
module under apps/ is parsed, never imported. A failure names the module, the line, the
import and the rule it breaks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
APPS = REPO / "apps"

# Imports of apps.* inside a function, each with why it cannot be at the top. Anything
# else at function level is a cycle in hiding: move the code to the right layer, or
# enqueue a job by name (apps.core.enqueue) instead.
FUNCTION_LEVEL_ALLOWED = {
    (
        "apps.monitoring.processes",
        "apps.core.guard",
    ): "celery_worker imports processes before Django is set up; the guard loads models",
    (
        "apps.monitoring.processes",
        "apps.monitoring.exposition",
    ): "celery_worker imports processes before Django is set up; exposition loads models",
    (
        "apps.monitoring.processes",
        "apps.monitoring.listener",
    ): "celery_worker imports processes before Django is set up; the listener loads models",
}
# AppConfig.ready hooks are Django's place for imports that need the app registry.
READY_HOOK = re.compile(r"^apps\.\w+\.apps$")

# Sending a Celery task by hand: only the one helper and the per-host timer do it.
SENDS = {"delay", "apply_async", "send_task"}
MAY_SEND = {"apps.core.enqueue", "apps.monitoring.processes"}


@dataclass(frozen=True)
class Layer:
    number: int
    name: str
    may_import: frozenset[int]


def read_layers() -> dict[str, Layer]:
    """Pattern (`apps.tasks`, `apps.*.models`) → its layer, from the document's table."""
    text = ARCHITECTURE.read_text()
    table = text.split("<!-- layers: the test reads this table -->", 1)[1].strip().splitlines()
    patterns: dict[str, Layer] = {}
    for line in table[2:]:  # after the header and its rule
        if not line.startswith("|"):
            break
        number, name, modules, may = (cell.strip() for cell in line.strip("|").split("|"))
        low, _, high = may.replace("–", "-").partition("-")
        layer = Layer(int(number), name, frozenset(range(int(low), int(high or low) + 1)))
        for pattern in re.findall(r"`([\w.*]+)`", modules):
            assert pattern not in patterns, f"{pattern} is in two rows of the layer table"
            patterns[pattern] = layer
    assert patterns, "no layer table found in docs/architecture.md"
    return patterns


def layer_of(module: str, patterns: dict[str, Layer]) -> tuple[str, Layer] | None:
    """The most specific pattern naming `module` (more dotted parts win; a named app wins
    over `*` at equal length)."""
    parts = module.split(".")
    best = None
    for pattern, layer in patterns.items():
        wanted = pattern.split(".")
        if len(wanted) > len(parts) or any(w not in ("*", p) for w, p in zip(wanted, parts, strict=False)):
            continue
        rank = (len(wanted), -wanted.count("*"))
        if best is None or rank > best[0]:
            best = (rank, pattern, layer)
    return None if best is None else (best[1], best[2])


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the apps.* module imported
    in_function: str | None  # the enclosing function, if any


def imports_of(path: Path) -> list[Import]:
    module = module_name(path)
    found: list[Import] = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if node.level or not node.module:
            raise AssertionError(f"{module}:{node.lineno}: relative import; write the full apps.* path")
        # `from apps.monitoring import metrics` imports the module apps.monitoring.metrics
        return [
            f"{node.module}.{alias.name}" if is_module(f"{node.module}.{alias.name}") else node.module
            for alias in node.names
        ]

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, function or child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target.startswith("apps."):
                        found.append(Import(module, child.lineno, target, function))
            else:
                visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), None)
    return found


def app_modules() -> list[Path]:
    return sorted(p for p in APPS.rglob("*.py") if "migrations" not in p.parts and p != APPS / "__init__.py")


def test_every_module_has_a_layer():
    patterns = read_layers()
    unplaced = [module_name(p) for p in app_modules() if layer_of(module_name(p), patterns) is None]
    assert not unplaced, "no row of the layer table in docs/architecture.md names: " + ", ".join(unplaced)


def test_imports_point_down_the_layers():
    patterns = read_layers()
    broken = []
    for path in app_modules():
        for imp in imports_of(path):
            placed = layer_of(imp.module, patterns)
            target = layer_of(imp.target, patterns)
            if placed is None or target is None:
                continue  # reported by test_every_module_has_a_layer
            (_, layer), (target_pattern, target_layer) = placed, target
            if target_layer.number not in layer.may_import:
                broken.append(
                    f"{imp.module}:{imp.line} imports {imp.target}: layer {layer.number} ({layer.name}) may not "
                    f"import layer {target_layer.number} ({target_layer.name}, via `{target_pattern}`)"
                )
    assert not broken, "upward imports (docs/architecture.md, Layers):\n" + "\n".join(broken)


def test_no_function_level_imports_of_apps():
    broken = []
    for path in app_modules():
        for imp in imports_of(path):
            if imp.in_function is None or (imp.module, imp.target) in FUNCTION_LEVEL_ALLOWED:
                continue
            if READY_HOOK.match(imp.module) and imp.in_function == "ready":
                continue
            broken.append(f"{imp.module}:{imp.line} imports {imp.target} inside {imp.in_function}()")
    assert not broken, (
        "imports of apps.* inside functions (import at the top; if that makes a cycle, the "
        "dependency points the wrong way: docs/architecture.md, Layers):\n" + "\n".join(broken)
    )


def test_the_allow_list_has_no_stale_entries():
    used = {(imp.module, imp.target) for path in app_modules() for imp in imports_of(path) if imp.in_function}
    assert set(FUNCTION_LEVEL_ALLOWED) <= used, set(FUNCTION_LEVEL_ALLOWED) - used


def test_a_module_resolves_to_its_most_specific_row():
    patterns = read_layers()
    assert layer_of("apps.monitoring.metrics", patterns)[1].name == "plumbing"
    assert layer_of("apps.monitoring.selectors", patterns)[1].name == "monitoring"
    assert layer_of("apps.tasks.models", patterns)[1].name == "schema"
    assert layer_of("apps.tasks.api.views", patterns)[1].name == "entry points"
    assert layer_of("apps.alerts.failures", patterns)[1].name == "failure policy"
    assert layer_of("apps.alerts.notifications.dispatch", patterns)[1].name == "alert store"
    assert layer_of("apps.gateway.catalog", patterns)[1].name == "gateway"
    assert layer_of("apps.gateway.choices", patterns)[1].name == "schema"
    assert layer_of("apps.gateway.api.route", patterns)[1].name == "entry points"


def calls_in(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            yield node


def test_jobs_are_asked_for_by_name_through_one_helper():
    broken = []
    for path in app_modules():
        module = module_name(path)
        for call in calls_in(path):
            if isinstance(call.func, ast.Attribute) and call.func.attr in SENDS and module not in MAY_SEND:
                broken.append(
                    f"{module}:{call.lineno} calls .{call.func.attr}(): use apps.core.enqueue.enqueue(name, …)"
                )
    assert not broken, "\n".join(broken)


def test_every_job_asked_for_by_name_exists():
    from celery import current_app

    from apps.core.enqueue import import_job_modules

    import_job_modules()
    asked = {}
    for path in [*app_modules(), *(REPO / "heteroflow").rglob("*.py")]:
        for call in calls_in(path):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
            # enqueue("name", …), or enqueue handed on with its name: run_in_executor(None, enqueue, "name")
            arguments = (
                call.args
                if name == "enqueue"
                else [
                    after
                    for before, after in zip(call.args, call.args[1:], strict=False)
                    if isinstance(before, ast.Name) and before.id == "enqueue"
                ]
            )
            if arguments and isinstance(arguments[0], ast.Constant):
                asked[arguments[0].value] = f"{module_name(path)}:{call.lineno}"
    assert {"scheduler.tick", "alerts.deliver_notification", "nodes.prune_metrics"} <= set(asked)
    unknown = {job: where for job, where in asked.items() if job not in current_app.tasks}
    assert not unknown, f"enqueue() names jobs no app declares: {unknown}"
