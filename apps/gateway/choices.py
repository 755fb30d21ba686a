"""The gateway's constants: the endpoint key's prefix, the balancers, the stickiness levels."""

from __future__ import annotations

from django.db import models

# An endpoint key: what a program puts in `Authorization: Bearer` to call /v1/*. It is
# neither a tenant key (sk-tenant-, the management API) nor an operator's (sk-admin-).
ENDPOINT_KEY_PREFIX = "sk-hf-"


class Balancer(models.TextChoices):
    ROUND_ROBIN = "round_robin", "Round robin"
    RANDOM = "random", "Random"
    LEAST_CONNECTIONS = "least_connections", "Least connections"


class Stickiness(models.TextChoices):
    """Where a request's session key came from, in the spec's order (first found wins)."""

    SESSION_HEADER = "session_header", "X-Session-Id header"
    PROMPT_CACHE_KEY = "prompt_cache_key", "prompt_cache_key"
    USER = "user", "user"
    CONVERSATION = "conversation", "hash(system + first user + first assistant)"
    PROMPT = "prompt", "hash(system + first user)"
