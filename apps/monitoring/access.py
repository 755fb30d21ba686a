"""Who may read /metrics without credentials.

Prometheus scrapers carry no application credentials, so /metrics takes none; instead
only peers on loopback, private (RFC 1918) and carrier-grade NAT (RFC 6598) addresses
are answered. The judgement is on the TCP peer alone: a forwarded header is whatever
the client chose to write. Behind a proxy the peer is the proxy, which only ever widens
the set of allowed clients to the proxy's, never blocks a scraper wrongly; put the
scraper next to the instance, or set HETEROFLOW_METRICS_ALLOW_PUBLIC=true.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings

SCRAPE_NETWORKS = tuple(
    ipaddress.ip_network(network)
    for network in ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)


def peer_may_scrape(peer: str | None) -> bool:
    if settings.HETEROFLOW_METRICS_ALLOW_PUBLIC:
        return True
    try:
        address = ipaddress.ip_address((peer or "").split("%", 1)[0])
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in SCRAPE_NETWORKS)
