"""The pure routing rules: the five levels of stickiness in the spec's order, the sticky
replica (stable while others come and go, falling through when unusable), the balancers."""

import random

import pytest

from apps.gateway import routing
from apps.gateway.choices import Stickiness

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hello"}
ASSISTANT = {"role": "assistant", "content": "hi!"}


def test_each_level_in_order():
    body = {"prompt_cache_key": "pck", "user": "u", "messages": [SYSTEM, USER, ASSISTANT]}
    assert routing.session_key("sess", body) == (Stickiness.SESSION_HEADER, "sess")
    assert routing.session_key(None, body) == (Stickiness.PROMPT_CACHE_KEY, "pck")
    del body["prompt_cache_key"]
    assert routing.session_key("  ", body) == (Stickiness.USER, "u")
    del body["user"]
    assert routing.session_key(None, body)[0] == Stickiness.CONVERSATION
    body["messages"] = [SYSTEM, USER]
    assert routing.session_key(None, body)[0] == Stickiness.PROMPT
    assert routing.session_key(None, {"messages": [SYSTEM]}) is None
    assert routing.session_key(None, {"prompt": "x"}) is None


def test_the_conversation_hashes():
    later_turn = [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "more"}, {"role": "assistant", "content": "x"}]
    level4, level5 = routing.conversation_keys(later_turn)
    assert (level4, level5) == routing.conversation_keys([SYSTEM, USER, ASSISTANT])  # only the first ones count
    assert routing.conversation_keys([SYSTEM, USER]) == (None, level5)
    assert routing.conversation_keys([USER])[1] != level5  # the system message is part of it
    assert routing.conversation_keys([{"role": "system", "content": "other"}, USER])[1] != level5
    parts = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert routing.conversation_keys(parts)[1] not in (None, level5)
    assert routing.conversation_keys("nope") == (None, None)
    assert routing.conversation_keys([1, None, {"role": "user"}])[1] is not None


def test_non_strings_and_long_values():
    assert routing.session_key(None, {"user": 5, "prompt_cache_key": ["x"]}) is None
    level, key = routing.session_key("x" * 10_000, {})
    assert level == Stickiness.SESSION_HEADER and len(key) == 32


def test_rendezvous_is_stable_while_replicas_come_and_go():
    replicas = [f"http://10.0.0.{i}:8000" for i in range(5)]
    keys = [f"session-{i}" for i in range(500)]
    before = {k: replicas[routing.rendezvous(k, replicas)] for k in keys}
    assert len(set(before.values())) == 5  # spread over all
    fewer = replicas[:4]
    after = {k: fewer[routing.rendezvous(k, fewer)] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == replicas[4] for k in moved)  # only the gone replica's sessions move
    assert routing.rendezvous("k", []) is None


def test_an_unusable_sticky_replica_falls_through():
    replicas = ["http://a", "http://b", "http://c"]
    chosen = routing.sticky_choice("s", replicas, replicas)
    assert chosen in replicas
    assert routing.sticky_choice("s", replicas, [r for r in replicas if r != chosen]) is None


def test_round_robin_random_least_connections():
    usable = ["a", "b", "c"]
    assert [routing.round_robin(i, usable) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]
    rng = random.Random(1)
    assert {routing.random_choice(usable, rng) for _ in range(50)} == set(usable)
    assert routing.least_connections([3, 1, 2]) == 1
    assert routing.least_connections([1, 1, 1], start=2) == 2
    assert routing.least_connections([0, 1, 0], start=1) == 2


@pytest.mark.parametrize("name", ["round_robin", "random", "least_connections"])
def test_balancer_names(name):
    assert routing.is_balancer(name) and not routing.is_balancer("weighted")


class S:
    def __init__(self, priority=0, weight=100):
        self.priority, self.weight = priority, weight


def test_pick_service_priority_with_fallback_then_weight():
    services = [S(priority=1, weight=1), S(priority=1, weight=3), S(priority=0)]
    assert routing.pick_service(services, [True, True, True], 0.0) == 0
    assert routing.pick_service(services, [True, True, True], 0.24) == 0
    assert routing.pick_service(services, [True, True, True], 0.26) == 1
    assert routing.pick_service(services, [True, True, True], 0.999) == 1
    assert routing.pick_service(services, [False, False, True], 0.5) == 2  # the fallback
    assert routing.pick_service(services, [False, True, True], 0.0) == 1
    assert routing.pick_service(services, [False, False, False], 0.5) is None
    even = [S(weight=0), S(weight=0)]
    assert [routing.pick_service(even, [True, True], d) for d in (0.1, 0.9)] == [0, 1]
    shares = [routing.pick_service([S(weight=1), S(weight=3)], [True, True], i / 1000) for i in range(1000)]
    assert shares.count(1) == 750
