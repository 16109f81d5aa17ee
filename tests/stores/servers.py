"""Real PostgreSQL and Redis servers for the tests of shared state (the stores tier,
and the providers and integration tiers' active-active tests).

Each test gets a database of its own (``CREATE DATABASE``, dropped after) and a
Redis key prefix of its own (its keys deleted after).  Where a server is absent
the test skips with a message naming it, except under ``CI=true``, where the
servers are part of the machine and their absence is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.loopback import free_port

PG_ADMIN = os.environ.get("VCACHE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("VCACHE_TEST_REDIS", "redis://127.0.0.1:6379/0")


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Await ``cond()`` (the other gateways' facts arriving), failing at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _absent(what: str, exc: BaseException) -> None:
    msg = f"{what} is not reachable ({exc}); the shared-state tests need it"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database (its URL), dropped at the end."""
    try:
        import psycopg

        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3)
    except Exception as exc:
        _absent(f"PostgreSQL at {PG_ADMIN}", exc)
        raise
    name = f"vcache_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name}")
    try:
        yield _with_db(PG_ADMIN, name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@contextlib.contextmanager
def redis_keys() -> Iterator[tuple[str, str]]:
    """(Redis URL, a key prefix of its own); its keys are deleted at the end."""
    try:
        import redis

        client = redis.Redis.from_url(REDIS, socket_connect_timeout=3)
        client.ping()
    except Exception as exc:
        _absent(f"Redis at {REDIS}", exc)
        raise
    prefix = f"vcache-test-{uuid.uuid4().hex[:12]}:"
    try:
        yield REDIS, prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped after the test."""
    with postgres_database() as url:
        yield url


@pytest.fixture
def redis_prefix() -> Iterator[tuple[str, str]]:
    """(Redis URL, a key prefix of this test's own); its keys are deleted after."""
    with redis_keys() as found:
        yield found


class ThrowawayRedis:
    """A Redis server of the test's own (the installed binary, another port, nothing
    kept on disk), to stop and start again: never the machine's."""

    def __init__(self, workdir: str) -> None:
        import shutil

        self.binary = shutil.which("redis-server") or ""
        if not self.binary:
            _absent("redis-server (the binary)", FileNotFoundError("not on PATH"))
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: Any = None

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None


@pytest.fixture
def throwaway_redis(tmp_path: Any) -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis(str(tmp_path))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class ThrowawayPostgres:
    """A PostgreSQL server of the test's own (the installed binaries, another port and
    data directory), to restart under load: never the machine's.  As root, the server
    runs as the ``postgres`` user (PostgreSQL refuses root)."""

    def __init__(self, workdir: str) -> None:
        import glob
        import shutil

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")) or [
            shutil.which("pg_ctl") or ""
        ]
        if not found[-1]:
            _absent("pg_ctl (the PostgreSQL server binaries)", FileNotFoundError("not found"))
        self.bindir = os.path.dirname(found[-1])
        self.port = free_port()
        self.workdir = workdir
        self.data = os.path.join(workdir, "pgdata")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(workdir, "postgres")
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres")

    def _run(self, tool: str, *args: str) -> None:
        import subprocess

        cmd = [*self._as, os.path.join(self.bindir, tool), *args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1"
        log = os.path.join(self.workdir, "server.log")
        self._run("pg_ctl", "-D", self.data, "-o", opts, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "stop")


@pytest.fixture
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix="vcache-pg-")  # not under pytest's root-only folder
    server = ThrowawayPostgres(workdir)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop("immediate")
        shutil.rmtree(workdir, ignore_errors=True)
