"""A worker's broker connection keeps the delivery layer's transport when kombu switches to the next broker URL.

kombu's `Connection.switch` (called by `maybe_switch_next` when a connection attempt fails and the broker URL lists
several) resets the transport to the next URL's scheme; `pipeline.delivery.failover.Connection` puts the bound
transport back. The parity test compares it with kombu's own switch computed now; the others connect for real to a
broker URL list whose first URL refuses connections and check that a job fetched after the switch holds a lease.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection as KombuConnection
from kombu import Consumer, Exchange, Producer, Queue

from pipeline.constants import LEASE_KEY
from pipeline.delivery import failover, transport
from pipeline.delivery.lease import Leases
from tests.support.procs import RedisServer, free_port


@pytest.fixture
def live_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def _urls(*ports: int) -> str:
    return ";".join(f"redis://127.0.0.1:{port}/0" for port in ports)


@pytest.mark.parity
def test_a_switch_keeps_the_bound_transport_and_is_kombus_otherwise() -> None:
    """After `maybe_switch_next`, kombu's own connection is on the URL's scheme (what the pipeline corrects), ours on
    the bound transport; every other parameter (host, port, credentials, options, alternates) is kombu's."""
    bound = transport.bound(Leases())
    urls = f"redis://:secret@127.0.0.1:{free_port()}/0;redis://u:pw@127.0.0.1:{free_port()}/2"
    options = {"visibility_timeout": 7}
    upstream = KombuConnection(urls, transport=bound, transport_options=options)
    ours = failover.Connection(urls, transport=bound, transport_options=options)
    assert upstream.transport_cls == ours.transport_cls == bound  # the same before any switch
    for conn in (upstream, ours):
        conn.maybe_switch_next()
    assert upstream.transport_cls == "redis"  # kombu resets it (if this fails, kombu keeps it now: see failover.py)
    assert ours.transport_cls == bound
    assert type(ours.transport).leases is not None  # built anew from the bound class: its channels reach the leases
    theirs, mine = upstream.info(), ours.info()
    for info in (theirs, mine):
        info.pop("transport")
    assert mine == theirs
    assert (ours.hostname, ours.port, ours.userid, ours.password, ours.virtual_host) == (
        "127.0.0.1",
        int(urls.rsplit(":", 1)[1].split("/")[0]),
        "u",
        "pw",
        "2",
    )
    clone = ours.clone()
    assert isinstance(clone, failover.Connection)
    clone.maybe_switch_next()
    assert clone.transport_cls == bound
    for conn in (upstream, ours, clone):
        conn.release()


def test_urls_of_another_kind_than_the_bound_transport_are_refused() -> None:
    bound = transport.bound(Leases(), sentinel=True)
    with pytest.raises(ValueError, match="mix schemes: redis beside sentinel"):
        failover.Connection(f"sentinel://127.0.0.1:{free_port()};redis://127.0.0.1:{free_port()}/0", transport=bound)
    # kombu's own transports are left as kombu handles them
    failover.Connection(f"sentinel://127.0.0.1:{free_port()};redis://127.0.0.1:{free_port()}/0").release()


def _fetch_one(conn: Any, queue: Queue) -> Any:
    """Connect (the first URL refuses: kombu switches to the next), publish one message and consume it."""
    conn.ensure_connection(max_retries=4, interval_start=0, interval_step=0.1, interval_max=0.2)
    Producer(conn.channel()).publish({"n": 1}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)]):
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    assert got, "nothing delivered"
    return got[0]


@pytest.mark.parametrize("cls", [failover.Connection, KombuConnection], ids=["pipeline", "kombu"])
def test_a_job_fetched_after_a_switch_is_leased(live_redis: RedisServer, cls: type[Any]) -> None:
    """A dead first URL, a live second one: the connection switches; with the pipeline's class the job it fetches
    there has a lease held by this worker, with kombu's own class (the transport reset to `redis`) none."""
    leases = Leases(lease_seconds=30)
    name = f"switch-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, "direct"), name)
    conn = cls(_urls(free_port(), live_redis.port), transport=transport.bound(leases))
    try:
        message = _fetch_one(conn, queue)
        assert conn.port == live_redis.port  # switched
        holder = live_redis.client().hget(LEASE_KEY, message.delivery_tag)
        if cls is failover.Connection:
            assert type(conn.transport).leases is leases
            assert holder is not None and holder.decode() == leases.owner()
            assert message.headers.get("x-delivery-count") == 1
        else:
            assert holder is None  # what the pipeline's class exists to prevent
            assert "x-delivery-count" not in message.headers
        message.ack()
    finally:
        conn.release()


def test_the_worker_app_builds_its_connections_with_the_pipeline_class(live_redis: RedisServer) -> None:
    """`install` (the delivery bootstep calls it) makes the app's consumer and producer connections ours."""
    from celery import Celery

    app = Celery("switch-test", broker=_urls(free_port(), live_redis.port), set_as_current=False)
    leases = Leases(lease_seconds=30)
    app.conf.broker_transport = transport.bound(leases)
    failover.install(app)
    with app.connection_for_read() as conn:
        assert isinstance(conn, failover.Connection)
        name = f"switch-app-{uuid.uuid4().hex[:8]}"
        message = _fetch_one(conn, Queue(name, Exchange(name, "direct"), name))
        assert live_redis.client().hget(LEASE_KEY, message.delivery_tag) == leases.owner().encode()
        message.ack()
    with app.connection_for_write() as conn:
        assert isinstance(conn, failover.Connection)
