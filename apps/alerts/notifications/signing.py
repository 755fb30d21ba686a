"""The webhook signature: HMAC-SHA256 with the channel's secret over
"<timestamp>.<body>", sent as `X-HeteroFlow-Signature: sha256=<hex>` with the timestamp
in `X-HeteroFlow-Timestamp` (Unix seconds). docs/alerts.md shows a receiver's check."""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-HeteroFlow-Signature"
TIMESTAMP_HEADER = "X-HeteroFlow-Timestamp"
DELIVERY_HEADER = "X-HeteroFlow-Delivery"
EVENT_HEADER = "X-HeteroFlow-Event"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()
