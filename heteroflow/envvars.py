"""Typed readers for environment variables.

Every value the control plane reads from its environment goes through one of these
readers, so that a bad value fails at start-up with a message that names the
variable, its value and the accepted range (never later, in a request).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from django.core.exceptions import ImproperlyConfigured

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


class Env:
    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ = os.environ if environ is None else environ

    def str(self, name: str, default: str | None = None) -> str | None:
        value = self.environ.get(name)
        if value is None or value.strip() == "":
            return default
        return value.strip()

    def bool(self, name: str, default: bool) -> bool:
        raw = self.str(name)
        if raw is None:
            return default
        word = raw.lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false)")

    def int(self, name: str, default: int, *, low: int, high: int) -> int:
        return self._number(name, default, low, high, int, "a whole number")

    def float(self, name: str, default: float, *, low: float, high: float) -> float:
        return self._number(name, default, low, high, float, "a number")

    def _number(self, name, default, low, high, parse, kind: str):
        raw = self.str(name)
        if raw is None:
            return default
        try:
            value = parse(raw)
        except ValueError:
            raise ImproperlyConfigured(f"{name}={raw!r} is not {kind}") from None
        if not low <= value <= high:  # also refuses nan
            raise ImproperlyConfigured(f"{name}={value} is outside {low}..{high}")
        return value

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = (self.str(name) or default).lower()
        if value not in choices:
            raise ImproperlyConfigured(f"{name}={value!r} must be one of {', '.join(choices)}")
        return value

    def cidr_list(self, name: str, default: list[str]) -> list[str]:
        """Comma-separated addresses or networks (10.0.0.0/8, 192.0.2.7, fd00::/8)."""
        import ipaddress

        values = self.list(name, default)
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ImproperlyConfigured(f"{name}: {value!r} is not an IP address or network") from None
        return values

    def address(self, name: str) -> tuple[str, int] | None:
        """A listening address HOST:PORT ([::1]:9090 for IPv6; :9090 for every interface),
        or None when unset."""
        raw = self.str(name)
        if raw is None:
            return None
        host, sep, port = raw.rpartition(":")
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ImproperlyConfigured(f"{name}={raw!r} is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9090)")
        host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
        if any(c.isspace() or c in "/[]" for c in host):
            raise ImproperlyConfigured(f"{name}={raw!r}: {host!r} is not a host name or address")
        return host, int(port)

    def list(self, name: str, default: list[str]) -> list[str]:
        raw = self.str(name)
        if raw is None:
            return list(default)
        return [item.strip() for item in raw.split(",") if item.strip()]

    def mapping(self, name: str, default: Mapping[str, str]) -> dict[str, str]:
        """`key=value,key=value` (a value may hold anything but a comma)."""
        raw = self.str(name)
        if raw is None:
            return dict(default)
        found: dict[str, str] = {}
        for item in (part.strip() for part in raw.split(",")):
            if not item:
                continue
            key, equals, value = item.partition("=")
            if not equals or not key.strip() or not value.strip():
                raise ImproperlyConfigured(f"{name}={raw!r}: {item!r} is not key=value")
            found[key.strip()] = value.strip()
        return found
