"""The agent's modules import each other one way, bottom to top in LAYERS, and never
the server: the agent is a separate package that speaks only the HTTP contract (the
twin of tests/core/test_layering.py for the server's apps).

Every module under heteroflow_agent/ is parsed, never imported; imports inside functions
count too (a lazy import is a dependency all the same). A failure names the module, the
line, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

AGENT = Path(__file__).resolve().parents[1]
PACKAGE = AGENT / "heteroflow_agent"
TESTS = AGENT / "tests"

# Bottom to top: a module may import its own layer and those below it, never one above.
# The most specific (longest) name wins: `heteroflow_agent.protocol` places
# `heteroflow_agent.protocol.task_status`.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "contract and settings",
        ("heteroflow_agent", "heteroflow_agent.protocol", "heteroflow_agent.config", "heteroflow_agent.version"),
    ),
    ("plumbing", ("heteroflow_agent.client", "heteroflow_agent.outcomes", "heteroflow_agent.checkpoint")),
    ("the host", ("heteroflow_agent.detect", "heteroflow_agent.collect")),
    ("runtimes and slices", ("heteroflow_agent.runtime", "heteroflow_agent.slicing")),
    ("engines", ("heteroflow_agent.engines", "heteroflow_agent.inventory", "heteroflow_agent.model_cache")),
    ("heartbeat", ("heteroflow_agent.heartbeat",)),
    (
        "a task's spec, delivery and log",
        (
            "heteroflow_agent.task_spec",
            "heteroflow_agent.interactive",
            "heteroflow_agent.delivery",
            "heteroflow_agent.logs",
        ),
    ),
    ("command channels", ("heteroflow_agent.channels",)),
    ("executor", ("heteroflow_agent.executor", "heteroflow_agent.reconcile")),
    ("tunnel", ("heteroflow_agent.tunnel",)),
    ("entry point", ("heteroflow_agent.main", "heteroflow_agent.__main__")),
)
# The server's packages and its framework: the agent (and its tests) import none of them.
SERVER = frozenset({"apps", "heteroflow", "django", "rest_framework", "celery"})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the module imported (a name imported from a module counts as that module)


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = AGENT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> list[Import]:
    """Every import in the file, at any depth, relative ones resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                named = f"{base}.{alias.name}"
                found.append(Import(module, node.lineno, named if is_module(named) else base))
    return found


def layer_of(module: str) -> tuple[int, str] | None:
    """(the layer's number, counted from 0 at the bottom; its most specific name)."""
    best = None
    for number, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (number, name)
    return best


def agent_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def internal_imports() -> list[Import]:
    return [
        imp for path in agent_modules() for imp in imports_of(path) if imp.target.split(".")[0] == "heteroflow_agent"
    ]


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in agent_modules() if layer_of(module_name(p)) is None]
    assert not unplaced, "no layer of LAYERS names: " + ", ".join(unplaced)


def test_imports_point_down_the_layers():
    broken = []
    for imp in internal_imports():
        placed, target = layer_of(imp.module), layer_of(imp.target)
        assert target is not None, f"{imp.module}:{imp.line} imports {imp.target}, which is no module of the agent"
        if placed is not None and target[0] > placed[0]:
            broken.append(
                f"{imp.module}:{imp.line} imports {imp.target}: layer {placed[0]} ({LAYERS[placed[0]][0]}) may not "
                f"import layer {target[0]} ({LAYERS[target[0]][0]}, via `{target[1]}`)"
            )
    assert not broken, "upward imports (agent/tests/test_layering.py, LAYERS):\n" + "\n".join(broken)


def test_no_module_imports_the_server():
    broken = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for path in [*agent_modules(), *sorted(TESTS.rglob("*.py"))]
        for imp in imports_of(path)
        if imp.target.split(".")[0] in SERVER
    ]
    assert not broken, "the agent never imports the server (it speaks only HTTP):\n" + "\n".join(broken)


def test_no_import_cycles():
    """Within a layer too: one module of a pair always comes first (engines/: names, then
    the launch table, then the router)."""
    graph: dict[str, set[str]] = {}
    for imp in internal_imports():
        if imp.target != imp.module:
            graph.setdefault(imp.module, set()).add(imp.target)
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layers_resolve_as_declared():
    assert layer_of("heteroflow_agent.protocol.task_status") == (0, "heteroflow_agent.protocol")
    assert layer_of("heteroflow_agent") == (0, "heteroflow_agent")
    assert layer_of("heteroflow_agent.detect.nvidia")[1] == "heteroflow_agent.detect"
    assert layer_of("heteroflow_agent.main")[0] == len(LAYERS) - 1
    # `from . import health` in detect/nvidia.py is detect.health; `from .base import X` in slicing/mig.py, slicing.base
    assert any(imp.target == "heteroflow_agent.detect.health" for imp in imports_of(PACKAGE / "detect" / "nvidia.py"))
    assert any(imp.target == "heteroflow_agent.slicing.base" for imp in imports_of(PACKAGE / "slicing" / "mig.py"))
