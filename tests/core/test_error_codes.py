"""Error codes (issue 29, point 11): each app names the codes it answers with in one enum,
`apps/<app>/error_codes.py` (as Saleor's `saleor/order/error_codes.py` does); every raise
site takes its code from one of them, never a bare string; and docs/api.md says what
each code means. Sources are parsed with `ast`; the enums are imported."""

from __future__ import annotations

import ast
import importlib
import re
from enum import StrEnum
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APPS = REPO / "apps"
API_DOC = REPO / "docs" / "api.md"
SOURCES = sorted(path for path in APPS.rglob("*.py") if "migrations" not in path.parts)

# Where a code goes in each way the code base answers an error: the callee's name and the
# position of its code argument (a `code=` keyword counts too, wherever it is passed).
CODE_ARGUMENT = {
    "Conflict": 1,  # apps.core.errors.Conflict(message, code)
    "error_body": 0,  # apps.core.errors.error_body(code, message, fields)
    "ErrorDetail": 1,  # DRF's ErrorDetail(string, code): a field's own code
    "HttpError": 1,  # the heartbeat route's HttpError(status, code, message)
    "_error": 1,  # the agent installer's _error(status, code, message)
    "GatewayError": 3,  # the gateway's GatewayError(status, message, type, code)
    "unauthorized": 1,  # and its helpers: unauthorized(message, code)
    "bad_request": 2,  # bad_request(message, param, code)
    "unavailable": 2,  # unavailable(message, retry, code)
}
# The gateway answers in OpenAI's shape with a vocabulary of its own (docs/gateway.md),
# so these words are in its enum as well as in the core one.
SHARED_WITH_THE_GATEWAY = {"https_required", "method_not_allowed", "payload_too_large", "server_error"}


def error_code_enums() -> list[type[StrEnum]]:
    enums = []
    for path in sorted(APPS.glob("*/error_codes.py")):
        module = importlib.import_module(f"apps.{path.parent.name}.error_codes")
        found = [value for name, value in vars(module).items() if name.endswith("ErrorCode")]
        assert len(found) == 1, f"{path.relative_to(REPO)}: one XErrorCode enum, found {len(found)}"
        enums.append(found[0])
    return enums


ENUMS = error_code_enums()


def code_nodes(tree: ast.AST) -> list[ast.expr]:
    """Every expression that gives an error its code: the code argument of a raise site,
    a `code=` keyword, a `code` parameter's default, a `default_code`, the `code` of an
    `{"error": {...}}` literal, and what an error's `.code` is compared with."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            position = CODE_ARGUMENT.get(name)
            if position is not None and len(node.args) > position:
                found.append(node.args[position])
            found += [keyword.value for keyword in node.keywords if keyword.arg == "code"]
        elif isinstance(node, ast.ClassDef) and node.name in CODE_ARGUMENT:
            # an error class's own constructors (GatewayError.rate_limited…: `cls(...)`)
            position = CODE_ARGUMENT[node.name]
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "cls":
                    if len(call.args) > position:
                        found.append(call.args[position])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            defaults = zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True)
            for argument, default in [*defaults, *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)]:
                if argument.arg == "code" and default is not None:
                    found.append(default)
        elif isinstance(node, ast.Assign):
            if any(isinstance(target, ast.Name) and target.id == "default_code" for target in node.targets):
                found.append(node.value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "error" and isinstance(value, ast.Dict):
                    found += [v for k, v in zip(value.keys, value.values, strict=True) if _is(k, "code")]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "code":
            found += node.comparators
    return found


def _is(node, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def test_each_app_has_one_str_enum_of_its_codes():
    assert {enum.__module__ for enum in ENUMS} >= {
        "apps.core.error_codes",
        "apps.tenants.error_codes",
        "apps.tasks.error_codes",
        "apps.nodes.error_codes",
        "apps.gateway.error_codes",
    }
    for enum in ENUMS:
        # a StrEnum is its value in JSON, in a metric's label and in str()
        assert issubclass(enum, StrEnum), f"{enum.__module__}.{enum.__name__} is not a StrEnum"
        for member in enum:
            assert member.name == member.value.upper(), f"{enum.__name__}.{member.name} = {member.value!r}"


def test_a_code_has_one_home():
    homes: dict[str, list[str]] = {}
    for enum in ENUMS:
        for member in enum:
            homes.setdefault(member.value, []).append(enum.__name__)
    twice = {
        code: names
        for code, names in homes.items()
        if len(names) > 1 and not (code in SHARED_WITH_THE_GATEWAY and len(names) == 2 and "GatewayErrorCode" in names)
    }
    assert not twice, f"codes defined in more than one enum: {twice}"


def test_no_raise_site_passes_a_bare_string_code():
    literal = []
    for path in SOURCES:
        for node in code_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literal.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not literal, "use the app's XErrorCode enum (apps/<app>/error_codes.py), not a string:\n" + "\n".join(
        literal
    )


def test_every_enum_member_named_in_the_code_exists():
    enums = {enum.__name__: enum for enum in ENUMS}
    missing = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in enums:
                if node.attr not in enums[node.value.id].__members__:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not missing, "\n".join(missing)


def test_the_scan_sees_the_raise_sites():
    """The scan above is only as good as CODE_ARGUMENT: it must find enum codes at the
    raise sites we know of, or a renamed helper would make it pass on nothing."""
    seen = set()
    for path in SOURCES:
        for node in code_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                seen.add(f"{node.value.id}.{node.attr}")
    assert {
        "TaskErrorCode.QUOTA_EXCEEDED",
        "CoreErrorCode.CONFLICT",
        "CoreErrorCode.PAYLOAD_TOO_LARGE",
        "GatewayErrorCode.RATE_LIMIT_EXCEEDED",
        "GatewayErrorCode.INVALID_API_KEY",
        "NodeErrorCode.UNSUPPORTED_ARCH",
        "InferenceErrorCode.FROZEN",
        "MonitoringErrorCode.FORBIDDEN",
    } <= seen


@pytest.mark.parametrize("code", sorted({member.value for enum in ENUMS for member in enum}))
def test_every_code_is_in_the_api_doc(code):
    assert re.search(rf"`{re.escape(code)}`", API_DOC.read_text()), f"docs/api.md does not name the code `{code}`"
