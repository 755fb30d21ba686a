"""on_live_connection (the heartbeat's and the gateway's pools): work that failed on a
connection the server had ended runs again on another, until one is live, as many times
as the pool has connections plus one (a restart ends all of them at once, and a
terminated backend's farewell may not have arrived when the pool's check looked); any
other failure is raised at once."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import psycopg
import pytest

from apps.core.db import on_live_connection


class Conn:
    def __init__(self, ended: bool):
        self.broken = False
        self.ended = ended


class Pool:
    """Hands out its connections in order: the first `ended` were ended by the server."""

    def __init__(self, max_size: int, ended: int):
        self.max_size = max_size
        self.conns = [Conn(ended=i < ended) for i in range(max_size + 2)]
        self.lent = 0

    @asynccontextmanager
    async def connection(self):
        conn = self.conns[self.lent]
        self.lent += 1
        yield conn


async def statement(conn: Conn) -> str:
    if conn.ended:
        conn.broken = True
        raise psycopg.OperationalError("terminating connection due to administrator command")
    return "written"


def test_every_pooled_connection_ended_at_once_fails_no_work():
    pool = Pool(max_size=2, ended=2)  # a restart: both pooled connections gone
    assert asyncio.run(on_live_connection(pool, statement)) == "written"
    assert pool.lent == 3


def test_a_live_connection_runs_the_work_once():
    pool = Pool(max_size=4, ended=0)
    assert asyncio.run(on_live_connection(pool, statement)) == "written"
    assert pool.lent == 1


def test_past_the_pools_size_plus_one_the_failure_is_raised():
    pool = Pool(max_size=2, ended=5)  # the server is down: every new connection dies too
    with pytest.raises(psycopg.OperationalError):
        asyncio.run(on_live_connection(pool, statement))
    assert pool.lent == 3


def test_a_failure_on_a_healthy_connection_is_not_retried():
    pool = Pool(max_size=4, ended=0)

    async def refused(conn):
        raise psycopg.OperationalError("canceling statement due to lock timeout")  # the connection lives on

    with pytest.raises(psycopg.OperationalError):
        asyncio.run(on_live_connection(pool, refused))
    assert pool.lent == 1
