"""Which backend serves a request: the session key (five levels of stickiness, in the
spec's order), the sticky backend (rendezvous hashing over the service's replicas), and
the balancers. Pure functions: no I/O, no clock, no Django; the route feeds them.

Stickiness, first found wins:
1. the `X-Session-Id` header,
2. the body's `prompt_cache_key`,
3. the body's `user`,
4. hash(system + first user + first assistant message), once the conversation has one,
5. hash(system + first user message).
The key is mapped to a replica by rendezvous (highest random weight) hashing over every
replica the service runs, healthy or not, so a session keeps its replica while others
come and go; when that replica is not usable (unhealthy, out of rotation after a
refused connection) the request falls through to the balancer.
"""

from __future__ import annotations

import hashlib
import random as _random
from collections.abc import Mapping, Sequence

import orjson

from apps.gateway.choices import Balancer, Stickiness

MAX_SESSION_CHARS = 512  # a longer header or field is hashed to this size's worth


def _text(value) -> str | None:
    if isinstance(value, str) and value.strip():
        return value if len(value) <= MAX_SESSION_CHARS else _digest(value)
    return None


def _digest(*parts) -> str:
    return hashlib.blake2b(orjson.dumps(parts), digest_size=16).hexdigest()


def _content(message) -> object:
    """A message's content as given (a string or a list of parts), for the hash."""
    return message.get("content") if isinstance(message, Mapping) else None


def conversation_keys(messages) -> tuple[str | None, str | None]:
    """(level 4, level 5) keys of a chat's messages: hash(system + first user + first
    assistant) when there is a first assistant message, and hash(system + first user)
    when there is a first user message. The system part is every system (or developer)
    message before the first user message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return None, None
    missing = object()
    system, first_user, first_assistant = [], missing, missing
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role in ("system", "developer") and first_user is missing:
            system.append(_content(message))
        elif role == "user" and first_user is missing:
            first_user = _content(message)
        elif role == "assistant" and first_user is not missing:
            first_assistant = _content(message)
            break
    if first_user is missing:
        return None, None
    level5 = _digest("prompt", system, first_user)
    level4 = _digest("conversation", system, first_user, first_assistant) if first_assistant is not missing else None
    return level4, level5


def session_key(session_header: str | None, body: Mapping) -> tuple[Stickiness, str] | None:
    """The request's session key and the level it came from, or None (no stickiness)."""
    header = _text(session_header)
    if header is not None:
        return Stickiness.SESSION_HEADER, header
    for level, name in ((Stickiness.PROMPT_CACHE_KEY, "prompt_cache_key"), (Stickiness.USER, "user")):
        value = _text(body.get(name))
        if value is not None:
            return level, value
    level4, level5 = conversation_keys(body.get("messages"))
    if level4 is not None:
        return Stickiness.CONVERSATION, level4
    if level5 is not None:
        return Stickiness.PROMPT, level5
    return None


def _weight(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest(), "big")


def rendezvous(key: str, names: Sequence[str]) -> int | None:
    """The index of `key`'s replica among `names` (highest random weight): stable for a
    key while the set changes, and only the keys of a replica that left move."""
    if not names:
        return None
    return max(range(len(names)), key=lambda i: _weight(key, names[i]))


def sticky_choice(key: str, replicas: Sequence[str], usable: Sequence[str]) -> str | None:
    """The replica of `key` among every replica of the service, if it is usable now;
    None: fall through to the balancer."""
    index = rendezvous(key, replicas)
    if index is None:
        return None
    chosen = replicas[index]
    return chosen if chosen in usable else None


def round_robin(counter: int, usable: Sequence[str]) -> str:
    return usable[counter % len(usable)]


def random_choice(usable: Sequence[str], rng: _random.Random | None = None) -> str:
    return (rng or _random).choice(usable)


def least_connections(counts: Sequence[int], start: int = 0) -> int:
    """The index of the fewest connections; ties go to the first from `start` on (the
    route passes a rotating start so ties spread). The atomic pick across processes is
    limits.ADMIT's, which applies this same rule inside Redis."""
    n = len(counts)
    best = None
    for j in range(n):
        i = (start + j) % n
        if best is None or counts[i] < counts[best]:
            best = i
    return best


def is_balancer(name: str) -> bool:
    return name in Balancer.values


def pick_service(services: Sequence, usable: Sequence[bool], draw: float) -> int | None:
    """Among the services serving one model name (each with `priority` and `weight`), the
    index of the one that takes this request: the highest priority among those with a
    usable replica, then by weight (`draw` in [0, 1): the caller's random number; weight
    0 everywhere: equal shares). None when no service has a usable replica."""
    candidates = [i for i, ok in enumerate(usable) if ok]
    if not candidates:
        return None
    top = max(services[i].priority for i in candidates)
    candidates = [i for i in candidates if services[i].priority == top]
    weights = [max(0, services[i].weight) for i in candidates]
    total = sum(weights)
    if total == 0:
        return candidates[min(int(draw * len(candidates)), len(candidates) - 1)]
    point = draw * total
    for i, weight in zip(candidates, weights, strict=True):
        if point < weight:
            return i
        point -= weight
    return candidates[-1]
