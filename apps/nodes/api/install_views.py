"""Agent installation over plain HTTP from the control plane alone (docs/agent-install.md).

    GET /api/v1/agent/install.sh                 the installer, rendered with this server's URL
    GET /api/v1/agent/update-agent-quick.sh      reinstall the agent package, restart
    GET /api/v1/agent/update-agent-force.sh      fresh virtual environment, everything reinstalled
    GET /api/v1/agent/dist/<arch>/               what the build for <arch> holds (JSON)
    GET /api/v1/agent/dist/<arch>/<file>         one file of it; SHA256SUMS lists them all

The scripts and the files are public: they hold no secret (the key is typed on the
node). The installer checks the key first with GET /api/v1/agent/auth-check (200 for
the agent key, 401 for a wrong one, 403 for a person's key), so it can refuse a wrong
key before it writes anything.
"""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body
from apps.nodes import distribution
from apps.nodes.error_codes import NodeErrorCode

SCRIPT_CONTENT_TYPE = "text/x-shellscript; charset=utf-8"
CONTENT_TYPES = {".whl": "application/octet-stream", ".json": "application/json"}


def _error(status: int, code: str, message: str, fields: dict | None = None) -> JsonResponse:
    response = JsonResponse(error_body(code, message, fields), status=status)
    response["Cache-Control"] = "no-store"
    return response


def _script(request, name: str) -> HttpResponse:
    server_url = distribution.server_url_for(request)
    try:
        text = distribution.render_script(name, server_url)
    except ValueError as exc:
        return _error(
            400, CoreErrorCode.INVALID, f"Cannot render {name} for this request: {exc}. Set HETEROFLOW_PUBLIC_URL."
        )
    response = HttpResponse(text, content_type=SCRIPT_CONTENT_TYPE)
    response["Content-Disposition"] = f'inline; filename="{name}"'
    response["Cache-Control"] = "no-store"
    return response


@require_safe
def install_script(request):
    return _script(request, "install.sh")


@require_safe
def update_quick_script(request):
    return _script(request, "update-agent-quick.sh")


@require_safe
def update_force_script(request):
    return _script(request, "update-agent-force.sh")


def _build_or_404(arch_name: str):
    arch = distribution.normalize_arch(arch_name)
    if arch is None:
        return None, _error(
            404,
            NodeErrorCode.UNSUPPORTED_ARCH,
            f"There is no agent build for architecture {arch_name!r}: this control plane builds for "
            f"{', '.join(distribution.SUPPORTED_ARCHES)} (aliases amd64, arm64) only.",
            {"arch": [f"Supported: {', '.join(distribution.SUPPORTED_ARCHES)}."]},
        )
    build = distribution.find_build(arch)
    if build is None:
        return None, _error(
            404,
            NodeErrorCode.NO_AGENT_BUILD,
            distribution.build_instructions(arch),
            {"arch": [f"Not built yet. Build it with: {distribution.build_command(arch)}"]},
        )
    return build, None


@require_safe
def dist_index(request, arch):
    build, problem = _build_or_404(arch)
    if problem:
        return problem
    base = request.path if request.path.endswith("/") else request.path + "/"
    response = JsonResponse(
        {
            "arch": build.arch,
            "agent": build.manifest.get("agent", {}),
            "python_min": build.manifest.get("python_min", distribution.MIN_PYTHON),
            "platforms": build.manifest.get("platforms", []),
            "sha256sums": base + distribution.SUMS_NAME,
            "files": [
                {
                    "name": name,
                    "sha256": digest,
                    "size": (build.directory / name).stat().st_size,
                    "url": base + name,
                }
                for name, digest in sorted(build.sums.items())
            ],
        }
    )
    response["Cache-Control"] = "no-cache"
    return response


@require_safe
def dist_file(request, arch, filename):
    build, problem = _build_or_404(arch)
    if problem:
        return problem
    path = build.file(filename)
    if path is None:
        return _error(
            404,
            CoreErrorCode.NOT_FOUND,
            f"The {build.arch} agent build has no file {filename!r}; {distribution.SUMS_NAME} lists what it has.",
        )
    try:
        content = path.read_bytes()
    except OSError:
        return _error(
            404,
            CoreErrorCode.NOT_FOUND,
            f"{filename} went away (a rebuild replaced the set); fetch {distribution.SUMS_NAME} again.",
        )
    suffix = "." + filename.rsplit(".", 1)[-1] if "." in filename else ""
    response = HttpResponse(content, content_type=CONTENT_TYPES.get(suffix, "text/plain; charset=utf-8"))
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    # A file's name does not change when a rebuild changes its content (the agent wheel
    # keeps its version), so nothing here is cached for long.
    response["Cache-Control"] = "no-cache"
    if filename != distribution.SUMS_NAME:
        response["X-Checksum-SHA256"] = build.sums[filename]
    return response
