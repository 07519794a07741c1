"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import RedisServer


@pytest.fixture(autouse=True)
def _services(services: None) -> None:
    """Start the session's Redis and SMTP server before the first test of this package."""


@pytest.fixture
def own_redis(work_dir: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop and restart (AOF in its directory survives a restart on the
    same port)."""
    server = RedisServer(work_dir / f"outage-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()


@pytest.fixture
def ledger_redis(work_dir: Path) -> Iterator[RedisServer]:
    """Where ledger jobs record their attempts and completions: never stopped, so the record is whole."""
    server = RedisServer(work_dir / f"ledger-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()
