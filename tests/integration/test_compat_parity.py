"""The replacements of `pipeline.compat` that need Redis, each run next to upstream's own code on the same input.

* The one-trip result store stores, expires and publishes each state as Celery's Redis backend does (and leaves a
  stored SUCCESS alone as it does).
* A publish recorded through kombu's batch hook is the envelope kombu LPUSHes when the same job is really sent.
* Beat's scheduler sends, in a tick, what redbeat's own `tick` sends and sleeps as long; its lock is the one
  redbeat's `acquire_distributed_beat_lock` takes.

Each expected value comes from the installed Celery, kombu or celery-redbeat, computed here: an upgrade that changes
their behaviour fails these tests (`make upgrade-check` runs them as the parity tier).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.schedules import schedule
from redbeat import RedBeatScheduler
from redbeat.schedulers import RedBeatSchedulerEntry, acquire_distributed_beat_lock

from pipeline.celery_app import get_app
from pipeline.compat import batch
from pipeline.compat.redbeat import Scheduler
from pipeline.compat.results import RedisBackend
from pipeline.queues.wake import WAKE_KEY
from tests.support.procs import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.parity]


def _comparable(stored: bytes | str) -> dict[str, Any]:
    """A stored or published meta without what differs by design: the task id and the instant it was stored."""
    meta = json.loads(stored)
    meta.pop("task_id")
    meta.pop("date_done")
    return dict(meta)


def test_a_state_is_stored_as_celerys_backend_stores_it(redis_server: RedisServer) -> None:
    app = get_app()
    ours = RedisBackend(app=app, url=redis_server.url)
    ours._verified = True  # the replacement runs whatever the installed versions (the parity tier's point)
    celerys = CeleryRedisBackend(app=app, url=redis_server.url)
    ids = {"ours": str(uuid.uuid4()), "celery": str(uuid.uuid4())}
    backends = {"ours": ours, "celery": celerys}
    keys = {name: ours.get_key_for_task(task_id) for name, task_id in ids.items()}
    client = redis_server.client()
    listener = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]  # unannotated
    listener.subscribe(*keys.values())
    for _ in keys:
        listener.get_message(timeout=1)  # the subscriptions' confirmations
    steps: list[tuple[str, Any]] = [
        ("PROGRESS", {"done": 1}),
        ("STARTED", None),
        ("SUCCESS", {"ok": True, "text": "é"}),
        ("FAILURE", RuntimeError("a late redelivery failed")),  # after a SUCCESS: left alone by both
    ]
    published: dict[bytes, list[dict[str, Any]]] = {key: [] for key in keys.values()}
    for state, result in steps:
        for name, backend in backends.items():
            if state == "FAILURE":
                backend.mark_as_failure(ids[name], result)
            else:
                backend.store_result(ids[name], result, state)
        stored = {name: client.get(key) for name, key in keys.items()}
        assert stored["ours"] is not None and stored["celery"] is not None
        assert _comparable(stored["ours"]) == _comparable(stored["celery"]), state
        ttls = [client.ttl(key) for key in keys.values()]
        assert abs(ttls[0] - ttls[1]) <= 1 and ttls[0] > 0, (state, ttls)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            message = listener.get_message(timeout=0.1)
            if message is not None:
                published[message["channel"]].append(_comparable(message["data"]))
    listener.close()
    ours_sent, celery_sent = published[keys["ours"]], published[keys["celery"]]
    assert ours_sent == celery_sent
    assert [m["status"] for m in ours_sent] == ["PROGRESS", "STARTED", "SUCCESS"]
    client.delete(*keys.values())


def _normalized(envelope: bytes | str) -> dict[str, Any]:
    """kombu's envelope without what differs between two publishes of one job: kombu's random delivery tag and
    the pipeline's publish-time stamp."""
    document = json.loads(envelope)
    document["properties"].pop("delivery_tag")
    document["headers"].pop("pipeline_published_at", None)
    return dict(document)


def test_a_recorded_publish_is_what_kombu_writes(redis_server: RedisServer) -> None:
    app = get_app()
    queue, task_id = f"parity-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())

    def send(producer: Any) -> Any:
        return app.send_task(
            "parity.noop", args=[{"n": 1, "text": "é"}], task_id=task_id, queue=queue, producer=producer, priority=3
        )

    client = redis_server.client()
    try:
        with app.producer_or_acquire() as producer:
            (recorded,) = batch.record(producer, [send])
            assert client.llen(queue) == 0  # recorded, not sent
            send(producer)
        pushes = [args for name, args in recorded if name == "lpush"]
        assert len(pushes) == 1
        (key, envelope) = pushes[0]
        (written,) = client.scan_iter(match=f"{queue}*")  # kombu's list for the queue at that priority
        assert key == written.decode()
        (sent,) = client.lrange(written, 0, -1)
        assert _normalized(envelope) == _normalized(sent)
    finally:
        client.delete(*client.scan_iter(match=f"{queue}*"))


@pytest.fixture
def beat_app(redis_server: RedisServer) -> Iterator[Celery]:
    """An app configured for redbeat on its own keys in the session's Redis, with no lock (ticks only)."""
    prefix = f"test-beat-parity-{uuid.uuid4().hex[:8]}:"
    app = Celery("beat-parity", broker=redis_server.url, set_as_current=False)
    app.conf.update(
        redbeat_redis_url=redis_server.url,
        redbeat_key_prefix=prefix,
        redbeat_lock_key=None,
        redbeat_lock_timeout=7,
        beat_max_loop_interval=5,
        timezone="UTC",
        enable_utc=True,
    )
    yield app
    client = redis_server.client()
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


def _recording(scheduler: Any) -> list[tuple[str, list[str]]]:
    """Record what `scheduler` sends (entry name, the keyword arguments' names) instead of sending it."""
    sent: list[tuple[str, list[str]]] = []

    def apply_async(entry: Any, **kwargs: Any) -> None:
        sent.append((entry.name, sorted(kwargs)))

    scheduler.apply_async = apply_async
    return sent


def test_a_tick_sends_what_redbeats_tick_sends(beat_app: Celery) -> None:
    now = beat_app.now()
    entries = [
        RedBeatSchedulerEntry("due", "parity.due", schedule(10), app=beat_app, last_run_at=now - timedelta(seconds=20)),
        RedBeatSchedulerEntry(
            "soon", "parity.soon", schedule(10), app=beat_app, last_run_at=now - timedelta(seconds=7)
        ),
        RedBeatSchedulerEntry("later", "parity.later", schedule(3600), app=beat_app, last_run_at=now),
    ]
    for entry in entries:
        entry.save()
    theirs = RedBeatScheduler(app=beat_app, lazy=True)
    ours = Scheduler(app=beat_app, lazy=True)
    assert (ours.lock_key, ours.max_interval) == (theirs.lock_key, theirs.max_interval) == (None, 5)
    their_sends, our_sends = _recording(theirs), _recording(ours)
    their_sleep = theirs.tick()
    our_sleep = ours.tick()
    assert our_sends == their_sends == [("due", ["producer"])]
    assert abs(our_sleep - their_sleep) < 0.5 and 2 < our_sleep < 4


def test_the_lock_is_the_one_redbeat_takes(beat_app: Celery, redis_server: RedisServer) -> None:
    beat_app.conf.redbeat_lock_key = f"{beat_app.conf.redbeat_key_prefix}lock"
    theirs_scheduler = RedBeatScheduler(app=beat_app, lazy=True)
    acquire_distributed_beat_lock(sender=SimpleNamespace(scheduler=theirs_scheduler))
    theirs = theirs_scheduler.lock
    ours = Scheduler(app=beat_app, lazy=True)._new_lock()
    assert type(ours) is type(theirs)
    assert (ours.name, ours.timeout, ours.sleep) == (theirs.name, theirs.timeout, theirs.sleep)
    assert ours.lua_extend.script == theirs.lua_extend.script
    assert not ours.acquire(blocking=False)  # the same lock: held by redbeat's
    theirs.release()
    assert ours.acquire(blocking=False)
    client = redis_server.client()
    client.pexpire(ours.name, 60_000)
    ours.extend(int(ours.timeout))  # redbeat's extend-to: the lease becomes the timeout, not 60 s plus it
    assert 0 < client.pttl(ours.name) <= ours.timeout * 1000
    ours.release()


def test_beat_sends_a_job_with_its_queues_wake_up_marker(beat_app: Celery, redis_server: RedisServer) -> None:
    """Beat's connection is Celery's on the marking transport (`pipeline.compat.marking`): a cron job lands with its
    queue's marker, so an idle worker starts it at once."""
    queue = f"beat-wake-{uuid.uuid4().hex[:8]}"
    ours = Scheduler(app=beat_app, lazy=True)
    entry = RedBeatSchedulerEntry(
        "wake", "parity.wake", schedule(10), args=[{"n": 1}], options={"queue": queue}, app=beat_app
    )
    client = redis_server.client()
    try:
        ours.apply_async(entry, producer=ours.producer)
        (sent,) = client.lrange(queue, 0, -1)
        assert json.loads(sent)["headers"]["task"] == "parity.wake"
        assert client.llen(WAKE_KEY.format(queue=queue)) == 1
    finally:
        client.delete(queue, WAKE_KEY.format(queue=queue))
        ours.connection.release()
