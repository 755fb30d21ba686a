"""The agent's installable artefacts: building them (`manage.py build_agent_dist`) and
finding them (the install endpoints in `apps/nodes/api/install_views.py`).

Everything lives under `settings.HETEROFLOW_AGENT_DIST_DIR` (default
`<data dir>/agent-dist`, outside git):

    wheelhouse/                every wheel fetched so far (all architectures) and the
                               build tools; reused, so a rebuild needs no network
    agent/<key>/               one built agent wheel per (commit, source content), with
                               its _build_info.json stamp inside
    releases/<arch>-<stamp>/   one published set: wheels, manifest.json, SHA256SUMS
    <arch> -> releases/…       what is served: a symlink, swapped atomically

A node installs with `pip install --no-index --find-links <downloaded set>`, so a set
holds the agent wheel, every dependency wheel (manylinux; abi3 or pure where the project
ships one, else one wheel per CPython in SERVED_PYTHONS, as for cffi, which
cryptography needs) and pip itself (the installer
bootstraps its virtual environment with it, which also works where Debian's
python3-venv / ensurepip is missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings

from apps.nodes.choices import DIRTY_BUILD_SUFFIX

SUPPORTED_ARCHES = ("x86_64", "aarch64")
ARCH_ALIASES = {"x86_64": "x86_64", "amd64": "x86_64", "x64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
# The oldest CPython the served wheels are chosen for. The agent's pinned requests
# (2.34.x) needs 3.10, so 3.10 it is: Ubuntu 22.04 (3.10), Debian 12 (3.11), Ubuntu 24.04
# (3.12) and Debian 13 (3.13) all have it.
MIN_PYTHON = "3.10"
# The CPythons a set carries version-specific wheels for (a dependency with no abi3 wheel,
# such as cffi under asyncssh's cryptography, needs one wheel per version).
SERVED_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
# Newest glibc a served wheel may need: 2.28 (RHEL 8, Debian 10, Ubuntu 18.10 and later).
GLIBC_CEILING = "2_28"
AGENT_PACKAGE = "heteroflow_agent"
BUILD_INFO_NAME = "_build_info.json"
SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "manifest.json"
AGENT_PATH = "/api/v1/agent"
SCRIPTS = ("install.sh", "update-agent-quick.sh", "update-agent-force.sh")
KEEP_RELEASES = 2
KEEP_AGENT_BUILDS = 3
PIP_NETWORK_OPTIONS = ["--timeout", "30", "--retries", "2"]

FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
SUM_LINE = re.compile(r"^([0-9a-f]{64}) [ *](\S+)$")
SAFE_URL = re.compile(r"^https?://[A-Za-z0-9.\-_:\[\]%@]+(/[A-Za-z0-9._~/%+-]*)?$")
PLACEHOLDER = re.compile(r"@@[A-Z_]+@@")
NETWORK_TROUBLE = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "SSLError",
    "Could not fetch URL",
)


class BuildError(Exception):
    """A build step failed; the message says what is missing and what to do."""


# --- naming ---------------------------------------------------------------------------


def normalize_arch(name: str) -> str | None:
    """`amd64`/`x86_64` → x86_64, `arm64`/`aarch64` → aarch64; None for anything else."""
    return ARCH_ALIASES.get((name or "").strip().lower())


def platform_tags(arch: str) -> list[str]:
    # pip expands manylinux_2_28 down to every older glibc (manylinux_2_5 … 2_27); the
    # legacy aliases are listed for pips that do not.
    return [f"manylinux_{GLIBC_CEILING}_{arch}", f"manylinux2014_{arch}", f"manylinux_2_17_{arch}"]


def dist_root() -> Path:
    return Path(settings.HETEROFLOW_AGENT_DIST_DIR)


def build_command(arch: str | None = None) -> str:
    return "python manage.py build_agent_dist" + (f" --arch {arch}" if arch else "")


def build_instructions(arch: str) -> str:
    return (
        f"This control plane has no agent build for {arch}. On the control plane, run "
        f"`{build_command(arch)}` (it needs PyPI access once, or the wheels already in "
        f"{dist_root() / 'wheelhouse'} and --offline); see docs/agent-install.md. "
        "The installer never falls back to another architecture's build."
    )


# --- checksums --------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_sums(text: str) -> dict[str, str]:
    """`<sha256>  <name>` lines (sha256sum's format) → {name: sha256}. Lines naming
    anything but a plain file name are ignored: a set is one flat folder."""
    sums: dict[str, str] = {}
    for line in text.splitlines():
        match = SUM_LINE.match(line.strip())
        if match and FILE_NAME.match(match.group(2)) and match.group(2) != SUMS_NAME:
            sums[match.group(2)] = match.group(1)
    return sums


def format_sums(directory: Path, names: Iterable[str]) -> str:
    return "".join(f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names))


# --- locating a published build --------------------------------------------------------


@dataclass(frozen=True)
class Build:
    arch: str
    directory: Path
    sums: dict[str, str]
    manifest: dict

    def file(self, name: str) -> Path | None:
        """The path of a served file, or None: only names listed in SHA256SUMS (and
        SHA256SUMS itself) are ever served."""
        if name == SUMS_NAME or name in self.sums:
            return self.directory / name
        return None


def find_build(arch: str, root: Path | None = None) -> Build | None:
    link = (root or dist_root()) / arch
    try:
        directory = link.resolve(strict=True)  # resolve first: a swap mid-request is harmless
        sums = parse_sums((directory / SUMS_NAME).read_text())
    except (OSError, RuntimeError):
        return None
    if not sums:
        return None
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        manifest = {}
    return Build(arch, directory, sums, manifest if isinstance(manifest, dict) else {})


def publish(arch: str, files: Iterable[Path], manifest: dict, root: Path | None = None) -> tuple[Build, bool]:
    """Publish one set for `arch`: copy the files into a new release folder, write
    manifest.json and SHA256SUMS (covering every file, manifest included), then point
    `<root>/<arch>` at it with an atomic symlink swap. An identical set is not
    republished. Returns (build, changed)."""
    root = root or dist_root()
    releases = root / "releases"
    releases.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=releases))
    try:
        names = []
        for path in files:
            if not FILE_NAME.match(path.name) or path.name in (SUMS_NAME, MANIFEST_NAME):
                raise BuildError(f"refusing to publish a file named {path.name!r}")
            shutil.copyfile(path, stage / path.name)
            names.append(path.name)
        (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        names.append(MANIFEST_NAME)
        sums_text = format_sums(stage, names)
        (stage / SUMS_NAME).write_text(sums_text)
        current = find_build(arch, root)
        if current is not None and (current.directory / SUMS_NAME).read_text() == sums_text:
            shutil.rmtree(stage)
            return current, False
        for child in stage.iterdir():
            child.chmod(0o644)
        stage.chmod(0o755)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        release = releases / f"{arch}-{stamp}"
        stage.rename(release)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    link = root / arch
    if link.exists() and not link.is_symlink():  # a folder made by hand: keep it aside
        link.rename(releases / f"{arch}-manual-{stamp}")
    temporary = root / f".{arch}.link-{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(Path("releases") / release.name)
    os.replace(temporary, link)
    _prune(releases, arch, keep=release)
    return find_build(arch, root), True


def _prune(releases: Path, arch: str, keep: Path) -> None:
    """Keep the new release and the one before it (a download that started before the
    swap can still finish), drop older ones."""
    mine = sorted(
        (p for p in releases.iterdir() if p.is_dir() and p.name.startswith(arch + "-") and p != keep),
        key=lambda p: p.name,
        reverse=True,
    )
    for old in mine[KEEP_RELEASES - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


# --- the install scripts ----------------------------------------------------------------


def script_dir() -> Path:
    return Path(settings.BASE_DIR) / "templates" / "agent"


def server_url_for(request) -> str:
    """The URL a node should talk back to: the configured public URL, else the scheme
    and host this request came in on."""
    configured = getattr(settings, "HETEROFLOW_PUBLIC_URL", "")
    if configured:
        return configured.rstrip("/")
    return request.build_absolute_uri("/").rstrip("/")


def render_script(name: str, server_url: str) -> str:
    """The script `name` with the shared functions spliced in and the server's own URL
    embedded. Placeholders are `@@NAME@@` (not Django templates: shell code is full of
    `{#` and `{{`)."""
    if name not in SCRIPTS:
        raise ValueError(f"no script named {name!r}")
    if not SAFE_URL.match(server_url):
        raise ValueError(f"{server_url!r} is not a URL that can be embedded in a shell script")
    directory = script_dir()
    text = (directory / name).read_text().replace("@@COMMON@@", (directory / "common.sh").read_text().rstrip("\n"))
    values = {
        "SERVER_URL": server_url,
        "AGENT_PATH": AGENT_PATH,
        "MIN_PYTHON": MIN_PYTHON,
        "ARCHES": " ".join(SUPPORTED_ARCHES),
        "SCRIPT_NAME": name,
    }
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    leftover = PLACEHOLDER.search(text)
    if leftover:
        raise ValueError(f"{name} has an unknown placeholder {leftover.group(0)}")
    return text


# --- building ---------------------------------------------------------------------------


@dataclass
class BuildOptions:
    arches: list[str] = field(default_factory=lambda: list(SUPPORTED_ARCHES))
    offline: bool = False
    refresh: bool = False
    rebuild: bool = False
    root: Path | None = None
    wheelhouse: Path | None = None
    source: Path | None = None
    find_links: list[Path] = field(default_factory=list)

    def __post_init__(self):
        self.root = Path(self.root or dist_root())
        self.wheelhouse = Path(self.wheelhouse or self.root / "wheelhouse")
        self.source = Path(self.source or Path(settings.BASE_DIR) / "agent").resolve()


@dataclass
class BuildResult:
    builds: dict[str, Build] = field(default_factory=dict)
    changed: dict[str, bool] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    agent: dict = field(default_factory=dict)


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL
    )


def _pip_output(proc: subprocess.CompletedProcess) -> str:
    lines = [
        line
        for line in (proc.stdout + "\n" + proc.stderr).splitlines()
        if line.strip() and "is ignored: it is neither a file nor a directory" not in line
    ]
    return "\n".join(lines)


def _missing_names(output: str) -> list[str]:
    found = re.findall(r"No matching distribution found for (\S+)", output)
    found += re.findall(r"Could not find a version that satisfies the requirement (\S+)", output)
    return list(dict.fromkeys(found))


NETWORK_REASON = re.compile(
    r"Failed to establish a new connection: [^'\")]*|Cannot connect to proxy|Temporary failure in name resolution"
    r"|Name or service not known|Network is unreachable|Connection refused|Read timed out|timed out"
    r"|certificate verify failed|SSLError"
)


def _network_trouble(output: str) -> str | None:
    """A short reason when pip's output says the index could not be reached."""
    for line in output.splitlines():
        if any(marker in line for marker in NETWORK_TROUBLE):
            reason = NETWORK_REASON.search(line)
            return reason.group(0).strip() if reason else line.strip()[:300]
    return None


def _tail(output: str, lines: int = 12) -> str:
    return "\n".join(output.splitlines()[-lines:])


def read_project(source: Path) -> dict:
    try:
        data = tomllib.loads((source / "pyproject.toml").read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"cannot read the agent's pyproject.toml in {source}: {exc}") from None
    project = data.get("project", {})
    if not project.get("version") or not project.get("name"):
        raise BuildError(f"{source / 'pyproject.toml'} has no [project] name/version")
    return {
        "name": project["name"],
        "version": str(project["version"]),
        "dependencies": list(project.get("dependencies", [])),
        "build_requires": list(data.get("build-system", {}).get("requires", ["setuptools", "wheel"])),
    }


def git_commit(source: Path) -> str:
    """`git rev-parse --short HEAD`, with `-dirty` when the agent's source folder has
    uncommitted changes (`git status --porcelain -- agent/`: the server's own files do not
    change what the wheel holds). `unknown` outside a git checkout."""

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(source), *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        status = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = head.stdout.strip()
    return commit + DIRTY_BUILD_SUFFIX if status.returncode != 0 or status.stdout.strip() else commit


def _source_ignore(source: Path):
    """What the copy of the agent's source leaves out: build leftovers and tests at its
    top, byte code everywhere, and any stale stamp (the build writes a fresh one)."""
    top = {"build", "dist", "tests", ".pytest_cache", ".git", ".venv"}

    def ignore(directory, names):
        here = Path(directory)
        skipped = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
        if here == source:
            skipped |= {n for n in names if n in top or n.endswith(".egg-info")}
        if here == source / AGENT_PACKAGE and BUILD_INFO_NAME in names:
            skipped.add(BUILD_INFO_NAME)
        return skipped

    return ignore


def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _build_key(commit: str, copy: Path) -> str:
    return hashlib.sha256(f"{commit}\0{_tree_digest(copy)}".encode()).hexdigest()[:16]


def agent_build_key(source: Path) -> str:
    """The name under `<dist>/agent/` of the wheel built from `source` as it is now."""
    source = Path(source).resolve()
    with tempfile.TemporaryDirectory(prefix="heteroflow-agent-src-") as scratch:
        copy = Path(scratch) / "src"
        shutil.copytree(source, copy, ignore=_source_ignore(source), symlinks=False)
        return _build_key(git_commit(source), copy)


def build_agent_wheel(options: BuildOptions, say: Callable[[str], None]) -> tuple[Path, dict]:
    """Build the agent wheel from a temporary copy of the source with `_build_info.json`
    stamped into it (the tree itself is never written). The same commit and content
    reuse the wheel built before (and its build time), unless `rebuild`."""
    source = options.source
    project = read_project(source)
    commit = git_commit(source)
    with tempfile.TemporaryDirectory(prefix="heteroflow-agent-src-") as scratch:
        copy = Path(scratch) / "src"
        shutil.copytree(source, copy, ignore=_source_ignore(source), symlinks=False)
        if not (copy / AGENT_PACKAGE).is_dir():
            raise BuildError(f"{source} has no {AGENT_PACKAGE}/ package")
        key = _build_key(commit, copy)
        cache = options.root / "agent" / key
        cached = sorted(cache.glob("*.whl")) if cache.is_dir() else []
        if cached and (cache / BUILD_INFO_NAME).is_file() and not options.rebuild:
            info = json.loads((cache / BUILD_INFO_NAME).read_text())
            say(
                f"agent wheel: reusing {cached[0].name} "
                f"({info['version']}, {info['git_commit']}, built {info['build_time']})"
            )
            return cached[0], info
        info = {
            "version": project["version"],
            "git_commit": commit,
            "build_time": datetime.now(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        (copy / AGENT_PACKAGE / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        say(f"agent wheel: building {project['name']} {info['version']} ({info['git_commit']}) from {source}")
        out = Path(scratch) / "out"
        wheel = _pip_wheel(copy, out, project, options, say)
        with zipfile.ZipFile(wheel) as archive:
            stamped = json.loads(archive.read(f"{AGENT_PACKAGE}/{BUILD_INFO_NAME}"))
        if stamped != info:
            raise BuildError(f"the built wheel {wheel.name} does not carry the build stamp")
        staging = Path(tempfile.mkdtemp(prefix=".agent-", dir=_mkdir(options.root / "agent")))
        shutil.copyfile(wheel, staging / wheel.name)
        (staging / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(cache, ignore_errors=True)
        staging.rename(cache)
    _prune_agent_builds(options.root / "agent", keep=cache)
    return cache / wheel.name, info


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prune_agent_builds(directory: Path, keep: Path) -> None:
    builds = sorted(
        (p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[KEEP_AGENT_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _local_links(options: BuildOptions) -> list[str]:
    args = ["--no-index", "--find-links", str(options.wheelhouse)]
    for extra in options.find_links:
        args += ["--find-links", str(extra)]
    return args


def _pip_wheel(copy: Path, out: Path, project: dict, options: BuildOptions, say) -> Path:
    _mkdir(options.wheelhouse)
    args = ["wheel", "--no-deps", "--wheel-dir", str(out), *_local_links(options), str(copy)]
    proc = _pip(args)
    if proc.returncode != 0:
        output = _pip_output(proc)
        tools_missing = _missing_names(output)
        if not tools_missing:
            raise BuildError(f"building the agent wheel failed:\n{_tail(output)}")
        if options.offline:
            raise BuildError(
                "cannot build the agent wheel offline: the build tools "
                f"({', '.join(tools_missing)}) are not in {options.wheelhouse}. Run once with network "
                f"(`{build_command()}`), or put their wheels there."
            )
        say(f"agent wheel: fetching the build tools ({', '.join(project['build_requires'])}) into {options.wheelhouse}")
        fetch = _pip(
            [
                "download",
                "--only-binary=:all:",
                "--dest",
                str(options.wheelhouse),
                *PIP_NETWORK_OPTIONS,
                *project["build_requires"],
            ]
        )
        if fetch.returncode != 0:
            fetched = _pip_output(fetch)
            raise BuildError(
                "cannot build the agent wheel: its build tools "
                f"({', '.join(project['build_requires'])}) are not in "
                f"{options.wheelhouse} and could not be downloaded" + _network_note(fetched)
            )
        proc = _pip(args)
        if proc.returncode != 0:
            raise BuildError(f"building the agent wheel failed:\n{_tail(_pip_output(proc))}")
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"pip wheel produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _network_note(output: str) -> str:
    trouble = _network_trouble(output)
    if trouble:
        return (
            f" (the package index could not be reached: {trouble}). Connect this machine to PyPI "
            "or a mirror (PIP_INDEX_URL), or copy the wheels into the wheelhouse and run with --offline."
        )
    return f":\n{_tail(output)}"


def _target_args(arch: str, python: str) -> list[str]:
    args = [
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        python,
        "--abi",
        "cp" + python.replace(".", ""),
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for tag in platform_tags(arch):
        args += ["--platform", tag]
    return args


def _for_each_python(run: Callable[[str], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """`run` for each served CPython in turn; the first failure, else the last answer."""
    for python in SERVED_PYTHONS:
        proc = run(python)
        if proc.returncode != 0:
            return proc
    return proc


def _resolve_locally(
    arch: str, requirements: list[str], dest: Path, options: BuildOptions
) -> subprocess.CompletedProcess:
    return _for_each_python(
        lambda python: _pip(
            ["download", "--dest", str(dest), *_local_links(options), *_target_args(arch, python), *requirements]
        )
    )


def _missing_locally(arch: str, requirements: list[str], options: BuildOptions) -> list[str]:
    """Each requirement on its own, to name every one that cannot be had offline."""
    missing = []
    for requirement in requirements:
        with tempfile.TemporaryDirectory(prefix="heteroflow-probe-") as scratch:
            proc = _resolve_locally(arch, [requirement], Path(scratch), options)
            if proc.returncode != 0:
                names = _missing_names(_pip_output(proc))
                missing.append(
                    requirement if not names or names == [requirement] else f"{requirement} (needs {', '.join(names)})"
                )
    return missing


def fetch_dependencies(arch: str, requirements: list[str], dest: Path, options: BuildOptions, say) -> list[Path]:
    """The dependency wheels for `arch` into `dest` (exactly the resolved set), taken
    from the wheelhouse when it has them, else downloaded into it first."""
    _mkdir(options.wheelhouse)
    if not options.refresh:
        proc = _resolve_locally(arch, requirements, dest, options)
        if proc.returncode == 0:
            say(f"{arch}: dependency wheels taken from {options.wheelhouse} (no download)")
            return sorted(dest.glob("*.whl"))
        if options.offline:
            missing = _missing_locally(arch, requirements, options) or _missing_names(_pip_output(proc))
            raise BuildError(
                f"{arch}: --offline, and these are not in {options.wheelhouse}"
                + "".join(f" or {p}" for p in options.find_links)
                + f" for manylinux/{arch}, CPython {', '.join(SERVED_PYTHONS)}: "
                + (", ".join(missing) or _tail(_pip_output(proc)))
                + f". Run `{build_command(arch)}` once with network, or copy the wheels there."
            )
        for leftover in dest.iterdir():
            leftover.unlink()
    say(f"{arch}: downloading dependency wheels ({', '.join(requirements)}) into {options.wheelhouse}")
    download = _for_each_python(
        lambda python: _pip(
            [
                "download",
                "--dest",
                str(options.wheelhouse),
                *PIP_NETWORK_OPTIONS,
                *_target_args(arch, python),
                *requirements,
            ]
        )
    )
    if download.returncode != 0:
        output = _pip_output(download)
        missing = _missing_locally(arch, requirements, options) if _network_trouble(output) else _missing_names(output)
        raise BuildError(
            f"{arch}: could not get the dependency wheels"
            + (f"; missing from {options.wheelhouse}: {', '.join(missing)}" if missing else "")
            + _network_note(output)
        )
    proc = _resolve_locally(arch, requirements, dest, options)
    if proc.returncode != 0:
        raise BuildError(f"{arch}: the downloaded wheels do not resolve:\n{_tail(_pip_output(proc))}")
    return sorted(dest.glob("*.whl"))


def build_dist(options: BuildOptions, say: Callable[[str], None] = print) -> BuildResult:
    """Build the agent wheel once, then for each architecture gather its dependency
    wheels and publish the set. An architecture that fails is reported in `failures`;
    the others are still published."""
    result = BuildResult()
    project = read_project(options.source)
    wheel, info = build_agent_wheel(options, say)
    result.agent = info | {"wheel": wheel.name}
    requirements = project["dependencies"] + ["pip"]
    for arch in options.arches:
        with tempfile.TemporaryDirectory(prefix=f"heteroflow-{arch}-") as scratch:
            try:
                deps = fetch_dependencies(arch, requirements, Path(scratch), options, say)
            except BuildError as exc:
                result.failures[arch] = str(exc)
                say(f"FAILED: {exc}")
                continue
            if not any(p.name.startswith("pip-") for p in deps):
                result.failures[arch] = f"{arch}: no pip wheel was resolved"
                continue
            manifest = {
                "arch": arch,
                "agent": {"name": project["name"], **info, "wheel": wheel.name},
                "python_min": MIN_PYTHON,
                "platforms": platform_tags(arch),
                "requirements": requirements,
            }
            build, changed = publish(arch, [wheel, *deps], manifest, options.root)
            result.builds[arch], result.changed[arch] = build, changed
            say(
                f"{arch}: {'published' if changed else 'unchanged'} {len(build.sums)} files "
                f"({_size(build):.1f} MiB) in {build.directory}"
            )
    return result


def _size(build: Build) -> float:
    return sum((build.directory / name).stat().st_size for name in build.sums) / (1 << 20)
