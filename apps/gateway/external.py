"""Operator-declared external OpenAI-compatible backends: where their URL may point.

An external backend puts an existing server behind the same keys, limits and metering.
Its URL must name a host on the operator's allow-list (HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED:
host names, `.suffix` for a domain and its sub-domains, or networks in CIDR form for
literal addresses), and no address it resolves to may be loopback, link-local (the cloud
metadata ranges), unspecified, multicast or reserved, nor the control plane's own names.
The check runs when the backend is declared and when it is changed; a name that later
resolves elsewhere is not re-checked per request (the allow-list names hosts the operator
trusts)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

ALWAYS_REFUSED = "loopback, link-local (metadata), unspecified, multicast and reserved addresses are never allowed"


def normal_base(url: str) -> str:
    """The URL the gateway appends `/v1/…` to: without a trailing `/` or `/v1`."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _allowed(host: str, address, allowed: Iterable[str]) -> bool:
    for entry in allowed:
        entry = entry.strip().lower()
        if not entry:
            continue
        if "/" in entry or entry.replace(".", "").isdigit() or ":" in entry:
            try:
                if address is not None and address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
        elif entry.startswith("."):
            if host == entry[1:] or host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False


def _never(address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return (
        address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    )


def url_problems(
    url: str,
    *,
    allowed: Iterable[str],
    own_hosts: Iterable[str],
    resolve: Callable[[str, int], list[str]],
) -> list[str]:
    """Why `url` may not be an external backend (empty: it may)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return ["Not a valid URL."]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ["Use an http(s) URL with a host, like https://llm.example.com/v1."]
    if parts.username or parts.password or parts.query or parts.fragment:
        return ["No user, password, query or fragment in the URL: the secret is a tenant secret's name."]
    host = parts.hostname.lower().rstrip(".")
    if host in {h.lower() for h in own_hosts if h and h != "*"} or host == "localhost":
        return ["The URL names the control plane itself."]
    allowed = list(allowed)
    if not allowed:
        return ["No external backends are allowed here (HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED is empty)."]
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if not _allowed(host, literal, allowed):
        return [f"'{host}' is not on the allow-list (HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED)."]
    try:
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in ([host] if literal else resolve(host, port))]
    except (OSError, UnicodeError, ValueError):
        return [f"Could not resolve '{host}'."]
    if not addresses:
        return [f"Could not resolve '{host}'."]
    refused = sorted({str(a) for a in addresses if _never(a)})
    if refused:
        return [f"'{host}' resolves to {', '.join(refused)}: {ALWAYS_REFUSED}."]
    return []


def resolve(host: str, port: int) -> list[str]:
    return [sockaddr[0] for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
