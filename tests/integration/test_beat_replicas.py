"""Beat's scheduler with REDIS_WAIT_REPLICAS: a slot is sent only once the replicas hold its reservation and the lock.

`pipeline.compat.redbeat.Scheduler` writes an entry's run again, in redbeat's layout, on a connection that then
WAITs (`_write_run`), and renews its lock with redbeat's extend-to script followed by WAIT (`_extend_lock`). The
parity test compares both with redbeat's own writes, computed now; the others run ticks against a Redis with no
replica (nothing is sent, the reservation is rolled back) and against a primary with a replica (sent once).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import schedule
from redbeat.schedulers import RedBeatSchedulerEntry

from pipeline import broker
from pipeline.compat.redbeat import Scheduler
from pipeline.config import get_settings
from pipeline.errors import NotReplicated
from tests.support.procs import RedisServer, wait_for
from tests.support.topology import Node


def _app(url: str) -> Celery:
    prefix = f"test-beat-wait-{uuid.uuid4().hex[:8]}:"
    app = Celery("beat-wait", broker=url, set_as_current=False)
    app.conf.update(
        redbeat_redis_url=url,
        redbeat_key_prefix=prefix,
        redbeat_lock_key=f"{prefix}lock",
        redbeat_lock_timeout=7,
        beat_max_loop_interval=5,
        timezone="UTC",
        enable_utc=True,
    )
    return app


def _stored(app: Celery, key: str, client: Any) -> tuple[Any, Any]:
    return client.hget(key, "meta"), client.zscore(app.redbeat_conf.schedule_key, key)


def _recording(scheduler: Any) -> list[str]:
    """Record the entries `scheduler` sends (after its reservation, as Celery's `apply_async` does)."""
    sent: list[str] = []

    def apply_async(entry: Any, **kwargs: Any) -> None:
        scheduler.reserve(entry)
        sent.append(entry.name)

    scheduler.apply_async = apply_async
    return sent


@pytest.fixture
def wait_one(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = get_settings().model_copy(update={"redis_wait_replicas": 1, "redis_wait_timeout_ms": 200})
    monkeypatch.setattr(broker, "get_settings", lambda: settings)


@pytest.mark.parity
def test_a_run_and_a_renewal_are_written_as_redbeat_writes_them(redis_server: RedisServer) -> None:
    app = _app(redis_server.url)
    client = redis_server.client()
    entry = RedBeatSchedulerEntry("e", "parity.e", schedule(10), app=app)
    entry.save()
    never_run = _stored(app, entry.key, client)
    theirs = next(entry)  # redbeat's `_next_instance`: the reservation
    their_write = _stored(app, entry.key, client)
    client.hdel(entry.key, "meta")
    client.zrem(app.redbeat_conf.schedule_key, entry.key)
    scheduler = Scheduler(app=app, lazy=True)
    scheduler._write_run(theirs, wait=False)
    assert _stored(app, entry.key, client) == their_write
    scheduler._restore_run(entry.key, *never_run)  # the rollback: as redbeat's `save` left it
    assert _stored(app, entry.key, client) == never_run

    scheduler.lock = scheduler._new_lock()
    assert scheduler.lock.acquire(blocking=False)
    client.pexpire(scheduler.lock.name, 60_000)
    scheduler._extend_lock()  # redbeat's `lock.extend(lock_timeout)`: the lease becomes the timeout
    assert 0 < client.pttl(scheduler.lock.name) <= scheduler.lock_timeout * 1000
    scheduler.lock.release()
    client.delete(entry.key, app.redbeat_conf.schedule_key)


def _due_entry(app: Celery) -> RedBeatSchedulerEntry:
    entry = RedBeatSchedulerEntry(
        "due", "parity.due", schedule(10), app=app, last_run_at=app.now() - timedelta(seconds=20)
    )
    entry.save()
    return entry


def test_without_a_replica_nothing_is_sent_and_the_slot_stays_due(redis_server: RedisServer, wait_one: None) -> None:
    """Redis has no replica: the lock's acquisition is not confirmed, so the tick sends nothing; once the lock counts
    (taken before), the reservation is not confirmed either: rolled back, nothing sent, the slot still due."""
    app = _app(redis_server.url)
    client = redis_server.client()
    entry = _due_entry(app)
    before = _stored(app, entry.key, client)
    scheduler = Scheduler(app=app, lazy=True)
    sent = _recording(scheduler)
    scheduler.tick()
    assert sent == []
    scheduler._lease_until = float("inf")  # the lease as if confirmed: the reservation alone is not
    with pytest.raises(NotReplicated):
        scheduler._send_due(min)
    assert sent == []
    assert _stored(app, entry.key, client) == before
    assert RedBeatSchedulerEntry.from_key(entry.key, app=app).is_due()[0]
    scheduler.close()


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Node]:
    primary = Node(tmp_path / "primary").start()
    replica = Node(tmp_path / "replica").start("--replicaof", "127.0.0.1", str(primary.port))
    yield primary
    primary.stop()  # first: a primary stopping waits (up to 10 s) for replicas that are gone to catch up
    replica.stop()


def test_with_a_replica_the_slot_is_sent_once_and_the_replica_holds_it(replicated: Node, wait_one: None) -> None:
    url = f"redis://127.0.0.1:{replicated.port}/0"
    # Acknowledging a write, not only connected: a replica's first acknowledgement of a write can come a second
    # after its sync, and a WAIT before it would fail the first tick (on Valkey it always did).
    client = replicated.client()
    wait_for(lambda: client.incr("replica-probe") and client.wait(1, 100) == 1, 15, what="the replica to acknowledge")
    app = _app(url)
    entry = _due_entry(app)
    scheduler = Scheduler(app=app, lazy=True)
    sent = _recording(scheduler)
    scheduler.tick()
    scheduler.tick()
    assert sent == ["due"]
    stored = RedBeatSchedulerEntry.from_key(entry.key, app=app)
    assert stored.last_run_at > entry.last_run_at
    assert not stored.is_due()[0]
    scheduler.close()
