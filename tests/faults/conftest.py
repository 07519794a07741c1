"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def own_leases(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that drive the worker transport themselves. The lease registry (`pipeline.runtime.lease`) is one
    per process, and an embedded worker (tests/support/inproc.py) runs the lease step's renewal thread in the
    test process, against the session's Redis: it would find this test's deliveries "lost" there. It skips its
    turns meanwhile (it holds nothing: the embedded worker consumes through kombu's own transport), and the
    registry starts and ends empty."""
    from pipeline.runtime import lease

    renew = lease.renew_once

    def renew_from_the_test_only(client: object, now: float | None = None) -> set[str]:
        if threading.current_thread().name == "pipeline-lease-renewer":
            return set()
        return renew(client, now)

    monkeypatch.setattr(lease, "renew_once", renew_from_the_test_only)
    _clear(lease)
    yield
    _clear(lease)


@pytest.fixture
def queue_name() -> str:
    return f"lease-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def conn(own_redis: RedisServer, own_leases: None) -> Iterator[Any]:
    """A kombu connection on the worker transport (`pipeline.runtime.transport`), to this test's own Redis."""
    from kombu import Connection

    from pipeline.runtime import transport

    with Connection(own_redis.url, transport=transport.Transport, transport_options={"visibility_timeout": 6}) as c:
        yield c


def _clear(lease: Any) -> None:
    with lease._lock:
        for registry in (
            lease._held,
            lease._lost,
            lease._pending_acks,
            lease._dropped,
            lease._pending_results,
            lease._settling,
        ):
            registry.clear()
