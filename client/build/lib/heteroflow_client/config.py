"""Where the client finds its server and key.

The file is `$XDG_CONFIG_HOME/heteroflow/config.toml` (`~/.config/heteroflow/config.toml`
when XDG_CONFIG_HOME is not set), written with mode 600 in a directory of mode 700:

    default_profile = "default"

    [profiles.default]
    url = "http://127.0.0.1:3333"
    key = "sk-tenant-…"

The profile is the one asked for (`--profile`, `Client(profile=…)`), else
HETEROFLOW_PROFILE, else the file's `default_profile`, else "default". HETEROFLOW_URL and
HETEROFLOW_API_KEY override the profile's url and key; explicit arguments override both.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heteroflow_client.errors import AuthError, HeteroFlowError

DEFAULT_PROFILE = "default"
ENV_PROFILE = "HETEROFLOW_PROFILE"
ENV_URL = "HETEROFLOW_URL"
ENV_KEY = "HETEROFLOW_API_KEY"
LOGIN_HINT = "run `hf login`"


def config_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "heteroflow"


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    return config_dir(environ) / "config.toml"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "heteroflow"


def _toml_loads(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.9 and 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def read_file(path: Path | None = None) -> dict:
    """The config file as a dict ({} when there is none)."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise HeteroFlowError(f"cannot read {path}: {exc}") from None
    try:
        return _toml_loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise HeteroFlowError(f"{path} is not valid TOML: {exc}") from None


def _quote(text: str) -> str:
    # A JSON string without ASCII escapes is a TOML basic string: the same escapes for
    # quotes, backslashes and control characters, and UTF-8 as itself.
    return json.dumps(text, ensure_ascii=False)


def _key(name: str) -> str:
    bare = name and all(ch.isascii() and (ch.isalnum() or ch in "-_") for ch in name)
    return name if bare else _quote(name)


def dumps(data: dict) -> str:
    """The config as TOML: top-level strings, then one table per profile."""
    lines = []
    for key, value in data.items():
        if not isinstance(value, dict):
            lines.append(f"{_key(key)} = {_value(value)}")
    for name, profile in (data.get("profiles") or {}).items():
        lines.append("")
        lines.append(f"[profiles.{_key(name)}]")
        for key, value in profile.items():
            lines.append(f"{_key(key)} = {_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return _quote(str(value))


def write_file(data: dict, path: Path | None = None) -> Path:
    """Write the config atomically: directory 700, file 600 from the moment it exists."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd, temporary = tempfile.mkstemp(prefix=".config-", suffix=".toml", dir=path.parent)  # mode 600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(dumps(data))
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


@dataclass
class Settings:
    """What a client connects with, and where each value came from."""

    url: str | None
    key: str | None
    profile: str
    path: Path

    def require(self) -> Settings:
        if not self.url:
            raise AuthError(f"no HeteroFlow server configured for profile {self.profile!r}: {LOGIN_HINT}")
        if not self.key:
            raise AuthError(f"no API key for profile {self.profile!r} ({self.url}): {LOGIN_HINT}")
        return self


def resolve(
    url: str | None = None,
    key: str | None = None,
    profile: str | None = None,
    environ: Mapping[str, str] | None = None,
    path: Path | None = None,
) -> Settings:
    """The url, key and profile to use: arguments, then the environment, then the file."""
    environ = os.environ if environ is None else environ
    path = path or config_path(environ)
    data = read_file(path)
    name = profile or environ.get(ENV_PROFILE) or data.get("default_profile") or DEFAULT_PROFILE
    stored = (data.get("profiles") or {}).get(name) or {}
    if profile and not stored and not (url or environ.get(ENV_URL)):
        raise HeteroFlowError(f"no profile {name!r} in {path}: {LOGIN_HINT} --profile {name}")
    return Settings(
        url=(url or environ.get(ENV_URL) or stored.get("url") or None),
        key=(key or environ.get(ENV_KEY) or stored.get("key") or None),
        profile=name,
        path=path,
    )


def save_profile(
    name: str,
    url: str,
    key: str,
    *,
    make_default: bool = False,
    environ: Mapping[str, str] | None = None,
    path: Path | None = None,
) -> Path:
    path = path or config_path(environ)
    data = read_file(path)
    profiles = data.setdefault("profiles", {})
    profiles[name] = {**profiles.get(name, {}), "url": url.rstrip("/"), "key": key}
    if make_default or "default_profile" not in data:
        data["default_profile"] = name
    return write_file(data, path)


def remove_profile(name: str, *, path: Path | None = None) -> bool:
    path = path or config_path()
    data = read_file(path)
    profiles = data.get("profiles") or {}
    if name not in profiles:
        return False
    del profiles[name]
    if data.get("default_profile") == name:
        data.pop("default_profile")
        if profiles:
            data["default_profile"] = next(iter(profiles))
    write_file(data, path)
    return True
