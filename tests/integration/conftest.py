"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.procs import RedisServer


@pytest.fixture(autouse=True)
def _services(services: None) -> None:
    """Start the session's Redis and SMTP server before the first test of this package."""


@pytest.fixture
def spare_queue(redis_server: RedisServer) -> Iterator[str]:
    """A queue of the session's Redis that no worker consumes, emptied afterwards (every priority level)."""
    from pipeline.broker import queue_keys

    queue = f"spare-{uuid.uuid4().hex[:8]}"
    yield queue
    redis_server.client().delete(*queue_keys(queue))
