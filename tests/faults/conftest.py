"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from kombu.asynchronous import Hub, set_event_loop

from tests.support.procs import RedisServer

if TYPE_CHECKING:
    from celery import Celery

    from tests.faults.revoking import Rig


@pytest.fixture(autouse=True)
def _services(services: None) -> None:
    """Start the session's Redis and SMTP server before the first test of this package."""


@pytest.fixture
def leases() -> Any:
    """The deliveries of a worker this test plays itself, driving the worker transport (`pipeline.delivery`): a state
    of its own, which no other worker in this process (an embedded one, tests/support/inproc.py) shares."""
    from pipeline.delivery.lease import Leases

    return Leases(lease_seconds=30)


@pytest.fixture
def queue_name() -> str:
    return f"lease-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def conn(own_redis: RedisServer, leases: Any) -> Iterator[Any]:
    """A kombu connection on the worker transport (`pipeline.delivery.transport`) bound to `leases`, to this test's
    own Redis."""
    from kombu import Connection

    from pipeline.delivery import transport

    with Connection(own_redis.url, transport=transport.bound(leases), transport_options={"visibility_timeout": 6}) as c:
        yield c


@pytest.fixture
def loop() -> Iterator[Hub]:
    """A kombu hub as the event loop of this thread, as a worker's consumer has (acknowledgements deferred)."""
    hub = Hub()
    hub._loop_thread = threading.get_ident()
    set_event_loop(hub)
    yield hub
    set_event_loop(None)
    hub.close()


@pytest.fixture
def revoke_rig(own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery) -> Rig:
    """A revoke test's broker, ledger, worker factory and producer in one (`tests.faults.revoking.Rig`)."""
    from tests.faults.revoking import Rig

    return Rig(own_redis, ledger_redis, make_worker, producer)
