"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api import ApiServer
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


@pytest.fixture(scope="module")
def fuzz_api(work_dir: Path) -> Iterator[ApiServer]:
    """The API of a fuzz test file, on a Redis of its own that no worker consumes (the fuzzed jobs it accepts, probe
    jobs asking to sleep for minutes say, are stored and never run); both stopped by PID after the file."""
    from tests.support.fuzz import TOKEN

    name = f"fuzz-{uuid.uuid4().hex[:6]}"
    redis = RedisServer(work_dir / name).start()
    server = ApiServer(name, work_dir / "logs", {"REDIS_URL": redis.url}, token=TOKEN).start()
    yield server
    server.stop()
    redis.stop()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_api: ApiServer) -> Any:
    """The schema `fuzz_api` serves (schemathesis')."""
    from tests.support.fuzz import served_schema

    return served_schema(fuzz_api)
