"""The gateway's own probe of the replicas it routes to, in each gateway process: every
PROBE_EVERY_SECONDS, each replica of the routes the catalog holds is asked for its
health; one that does not answer (or answers 5xx) is out of rotation until the next
probe says otherwise, one that answers is back at once. The same loop drops the
catalog's stale entries every CLEAN_EVERY_SECONDS."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from apps.gateway.catalog import Catalog

logger = logging.getLogger(__name__)

PROBE_EVERY_SECONDS = 10.0
PROBE_TIMEOUT_SECONDS = 2.0
PROBE_PATHS = ("/health", "/v1/models")  # the engines' health endpoint, else the models list
CLEAN_EVERY_SECONDS = 300.0  # stale cache entries dropped


class Prober:
    """Probes on the gateway's HTTP client (`client()`: the session of the running loop)
    and records what it finds in `catalog`."""

    def __init__(self, catalog: Catalog, client: Callable[[], aiohttp.ClientSession]):
        self.catalog, self.client = catalog, client

    async def forever(self) -> None:
        cleaned = time.monotonic()
        while True:
            await asyncio.sleep(PROBE_EVERY_SECONDS)
            try:
                await self.once()
                if time.monotonic() - cleaned >= CLEAN_EVERY_SECONDS:
                    cleaned = time.monotonic()
                    self.catalog.clean(CLEAN_EVERY_SECONDS)
            except Exception:
                logger.warning("the gateway's backend probe failed", exc_info=True)

    async def once(self) -> dict[str, bool]:
        """Every replica probed once, each put out of rotation or back: address → answered."""
        addresses = sorted(self.catalog.known_backends())
        results = await asyncio.gather(*(self.probe(address) for address in addresses))
        for address, ok in zip(addresses, results, strict=True):
            if ok:
                self.catalog.release(address)
            else:
                self.catalog.quarantine(address, PROBE_EVERY_SECONDS + PROBE_TIMEOUT_SECONDS)
        return dict(zip(addresses, results, strict=True))

    async def probe(self, address: str) -> bool:
        client = self.client()
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        for path in PROBE_PATHS:
            try:
                async with client.get(address + path, timeout=timeout, allow_redirects=False) as response:
                    if response.status == 404:
                        continue  # no such endpoint on this engine: try the next
                    return response.status < 500
            except (aiohttp.ClientError, TimeoutError):
                return False
        return False
