"""A cluster-wide limit of 20/s holds across 4 worker processes; throttled jobs are deferred, not failed."""

from __future__ import annotations

import bisect
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.constants import HEADER_RATE_GRANT, HEADER_RATE_SLOT, RATE_LIMIT_KEY
from pipeline.fairness.rates import ClusterRate
from tests.support.limited import QUEUE, limited, starts
from tests.support.monitor import Monitor
from tests.support.procs import RedisServer, wait_progressing

pytestmark = pytest.mark.integration

JOBS = 200
RATE = 20


def max_in_any_window(times: list[float], width: float = 1.0) -> int:
    """The most starts inside any window [t, t + width) beginning at a start."""
    return max(bisect.bisect_left(times, t + width) - i for i, t in enumerate(times))


def new_slot_asks(commands: list[dict[str, Any]], key: str) -> int:
    """The calls MONITOR saw ask `key`'s limiter for a new slot (`rate_acquire.lua` with KEYS[1] `key` and no carried
    slot); neither the slots a worker's fetch takes nor a deferred job's on its slot are among them."""
    asks = 0
    for command in commands:
        words = command["command"].split(" ")
        asks += words[0].upper() == "EVALSHA" and words[2:4] == ["1", key] and words[6:] in ([], [""])
    return asks


def test_cluster_rate_uses_celery_rate_syntax() -> None:
    assert ClusterRate("20/s").interval() == pytest.approx(0.05)
    assert ClusterRate("120/m").interval() == pytest.approx(0.5)
    assert ClusterRate(lambda: "2/s").interval() == pytest.approx(0.5)
    for bad in ("20 per second", "0/s", "5/d"):
        with pytest.raises(ValueError, match="N/s"):
            ClusterRate(bad)


def test_limit_holds_across_four_processes_and_nothing_fails(
    make_worker: Any, redis_server: RedisServer, clean_dlq: None
) -> None:
    limiter = RATE_LIMIT_KEY.format(task="test.limited")
    redis_server.client().delete(limiter)
    make_worker("rate-a", queues=QUEUE, concurrency=2)
    make_worker("rate-b", queues=QUEUE, concurrency=2)
    key = uuid.uuid4().hex
    with Monitor(redis_server.client()) as seen:
        ids = [limited.enqueue({"key": key, "n": i}) for i in range(JOBS)]
        wait_progressing(lambda: len(starts(key)), JOBS, 30, what=f"{JOBS} rate-limited jobs")
    asked = new_slot_asks(seen.commands, limiter)
    results = [limited.result(task_id, timeout=30) for task_id in ids]
    times = starts(key)

    assert len(times) == JOBS  # each job ran once
    peak = max_in_any_window(times)
    rel = [round(t - times[0], 2) for t in times]
    print(f"peak {peak} starts/s over {times[-1] - times[0]:.1f}s")
    assert peak <= RATE * 1.1, f"{peak} starts in one second: {rel}"
    assert times[-1] - times[0] >= (JOBS - 1) / RATE - 1  # the limit, not the workers, set the pace
    assert all(r.attempt == 1 for r in results), "a throttled job was counted as a failed attempt"
    assert all(AsyncResult(i, app=get_app()).state == "SUCCESS" for i in ids)
    assert redis_server.client().llen("dead_letter") == 0
    # A job's first slot comes with the fetch that takes it: only a job late for it (held in a worker's prefetch while
    # its processes were busy) asks for a new one (each of the 200 did, before the fetch took them).
    assert asked < JOBS * 0.75, f"{asked} jobs of {JOBS} asked the limiter for a new slot"


#: The forged jobs' task: 2 a second, so half an interval (how late a slot may be started on) is 250 ms.
SLOW, SLOW_RATE = "test.limited-slow", 2


def _forge(redis_server: RedisServer, key: str, headers: Any, jobs: int) -> None:
    """Send `jobs` jobs of SLOW as any producer can, each with `headers(now)` of its own, about 20 a second."""
    forger = Celery("forger", broker=redis_server.url, set_as_current=False)
    forger.conf.update(task_serializer="json")
    try:
        for n in range(jobs):
            forger.send_task(SLOW, args=[{"key": key, "n": n}], queue=QUEUE, headers=headers(time.time()))
            time.sleep(0.05)  # a steady stream: each is taken as it arrives
    finally:
        forger.close()


def _limit_held(key: str, jobs: int) -> None:
    """Every job started once, at most SLOW_RATE a second (one more for a start's own jitter), the limit setting the
    pace."""
    wait_progressing(lambda: len(starts(key)), jobs, 30, what=f"{jobs} rate-limited jobs")
    times = starts(key)
    peak = max_in_any_window(times)
    assert len(times) == jobs
    assert peak <= SLOW_RATE + 1, f"{peak} starts in one second: {[round(t - times[0], 2) for t in times]}"
    assert times[-1] - times[0] >= (jobs - 1) / SLOW_RATE - 1


def test_a_grant_a_producer_nests_in_a_headers_entry_is_not_honoured(
    make_worker: Any, redis_server: RedisServer, clean_dlq: None
) -> None:
    """Only the worker's fetch sets a delivery's rate grant (a top-level header it drops from any message first); one a
    producer nests in a `headers` entry (Celery makes it `request.headers`), due as it is sent, gives no slot: the
    limit holds."""
    limiter = RATE_LIMIT_KEY.format(task=SLOW)
    redis_server.client().delete(limiter)
    make_worker("rate-grant", queues=QUEUE, concurrency=4)
    key = uuid.uuid4().hex

    def grant(now: float) -> dict[str, Any]:
        return {"headers": {HEADER_RATE_GRANT: {"key": limiter, "slot": now, "due": now}}}

    _forge(redis_server, key, grant, 20)
    _limit_held(key, 20)


def test_slots_a_producer_writes_do_not_let_jobs_start_together(
    make_worker: Any, redis_server: RedisServer, clean_dlq: None
) -> None:
    """A deferred job starts on the slot the limiter recorded for it; a `pipeline_rate_slot` header the limiter never
    recorded (twelve jobs, one slot three seconds ahead) gets each job a slot of its own: they do not start
    together."""
    redis_server.client().delete(RATE_LIMIT_KEY.format(task=SLOW))
    make_worker("rate-slot", queues=QUEUE, concurrency=4)
    key = uuid.uuid4().hex
    slot = time.time() + 3
    _forge(redis_server, key, lambda now: {HEADER_RATE_SLOT: slot}, 12)
    _limit_held(key, 12)


class StubTask:
    """What `admit` needs of a Celery task: its request, name, state updates and a re-publish."""

    def __init__(self, headers: dict[str, Any] | None = None, limit: ClusterRate | None = None) -> None:
        self.name = f"test.stub-{uuid.uuid4().hex[:8]}"
        self.cluster_limit = limit
        # Celery's request: each message header an attribute, the custom ones also in `headers`.
        fields = {"id": uuid.uuid4().hex, "headers": headers, "retries": 0, **(headers or {})}
        self.request = type("Request", (), fields)()
        self.states: list[tuple[str, dict[str, Any]]] = []
        self.published: list[dict[str, Any]] = []

    def update_state(self, state: str, meta: dict[str, Any]) -> None:
        self.states.append((state, meta))

    def signature_from_request(self, request: Any, **options: Any) -> Any:
        stub = self

        class Sig:
            def apply_async(self, **more: Any) -> None:
                stub.published.append({**options, **more})

        return Sig()


def test_throttled_job_is_republished_for_its_slot_and_counted(redis_server: RedisServer) -> None:
    from celery.exceptions import Ignore

    from pipeline.constants import HEADER_THROTTLED, RATE_SLOT_KEY
    from pipeline.observability import metrics
    from pipeline.scheduling.ratelimit import admit, record

    limit = ClusterRate("1/s", key=lambda job: str(job))
    first, second, other = StubTask(limit=limit), StubTask(limit=limit), StubTask(limit=limit)
    second.name = other.name = first.name
    before = time.time()
    admit(first, "host-a")  # type: ignore[arg-type]  # the first token: runs now
    between = time.time()
    assert first.published == []
    admit(other, "host-b")  # another key has its own limit
    assert other.published == []
    with pytest.raises(Ignore):
        admit(second, "host-a")
    after = time.time()
    [again] = second.published
    slot = again["headers"][HEADER_RATE_SLOT]
    assert again["headers"][HEADER_THROTTLED] == 1
    # One interval after the first job's slot, which Redis's clock (this host's) read during the first call.
    assert before + 1 - 0.001 <= slot <= between + 1 + 0.001
    # The ETA is this host's clock after the script's reply plus the wait, the slot Redis's clock in the script plus
    # the wait: the ETA is later, by no more than the call took.
    assert -0.001 <= again["eta"].timestamp() - slot <= after - between + 0.001
    assert second.states[0][0] == "THROTTLED"
    counted = metrics.rate_limit_throttled.labels(task=second.name)._value.get()
    assert counted == 1
    # The deferred message starts on the slot recorded for it, without asking the limiter again; a message whose
    # slot header the limiter never recorded asks for a slot of its own.
    assert float(redis_server.client().get(RATE_SLOT_KEY.format(id=second.request.id))) == slot
    arrived = StubTask({HEADER_RATE_SLOT: slot}, limit)
    arrived.name, arrived.request.id = first.name, second.request.id
    record(limit, arrived.request.id, time.time(), 0.0)  # (as if it arrived on its slot)
    admit(arrived, "host-a")  # type: ignore[arg-type]
    assert arrived.published == [] and not redis_server.client().exists(RATE_SLOT_KEY.format(id=second.request.id))
    forged = StubTask({HEADER_RATE_SLOT: time.time()}, limit)
    forged.name = first.name
    with pytest.raises(Ignore):
        admit(forged, "host-a")  # type: ignore[arg-type]  # host-a's next slot, after the deferred one's
    assert forged.published[0]["headers"][HEADER_RATE_SLOT] - slot == pytest.approx(1.0, abs=0.01)
    keys = [RATE_LIMIT_KEY.format(task=first.name) + f":{host}" for host in ("host-a", "host-b")]
    redis_server.client().delete(*keys)


def test_a_job_starts_on_the_slot_its_fetch_took_unless_it_is_not_its_own_or_late(redis_server: RedisServer) -> None:
    from celery.exceptions import Ignore

    from pipeline.scheduling.ratelimit import admit

    # Half an interval is 30 s (no stall here comes near it); a burst of 3 lets an ask start at once (nothing parked).
    limit = ClusterRate("1/m", burst=3, key=lambda job: str(job))
    name = f"test.stub-{uuid.uuid4().hex[:8]}"
    limiter = RATE_LIMIT_KEY.format(task=name) + ":host-a"
    client = redis_server.client()

    def task(due: float, key: str = limiter, slot: float = 1e10) -> StubTask:
        stub = StubTask({HEADER_RATE_GRANT: {"key": key, "slot": slot, "due": due}}, limit)
        stub.name = name
        return stub

    admit(task(time.time()), "host-a")  # type: ignore[arg-type]  # its own, on time: starts, asks nothing
    admit(task(time.time() - 10), "host-a")  # type: ignore[arg-type]  # within half an interval of it
    assert not client.exists(limiter)
    ahead = task(time.time() + 1, slot=123.0)
    with pytest.raises(Ignore):
        admit(ahead, "host-a")  # type: ignore[arg-type]  # due later: deferred to the slot it was given
    assert ahead.published[0]["headers"][HEADER_RATE_SLOT] == 123.0 and not client.exists(limiter)
    admit(task(time.time(), key=limiter + "-other"), "host-a")  # type: ignore[arg-type]  # not its key: asks
    asked = float(client.get(limiter) or 0)
    late = task(time.time() - 60)
    admit(late, "host-a")  # type: ignore[arg-type]  # a minute late for its slot: asks again (and starts: a burst)
    assert late.published == [] and float(client.get(limiter) or 0) == pytest.approx(asked + 60_000, abs=0.2)
    client.delete(limiter)


def test_an_event_loop_asks_for_hundreds_of_slots_at_once_and_every_call_is_answered(redis_server: RedisServer) -> None:
    """The asyncio pool's jobs ask the limiter on their loop's own client (`acquire_async`), hundreds at once when a
    process's jobs end together: the client's connections are bounded and waited for, never refused (a refusal
    failed the job, dead-lettered as if its input were bad)."""
    import asyncio

    from pipeline.pools import aio
    from pipeline.scheduling.ratelimit import acquire_async

    limit = ClusterRate("1000000/s", key=lambda job: str(job))
    name = f"test.burst-{uuid.uuid4().hex[:8]}"

    async def burst() -> list[tuple[float, float]]:
        try:
            return await asyncio.gather(*(acquire_async(limit, name, "host", None) for _ in range(400)))
        finally:
            await aio.close_loop_resources()

    answers = asyncio.run(burst())
    assert len(answers) == 400
    assert max(wait for wait, _ in answers) < 0.05  # far below the rate: each slot is (about) now
    redis_server.client().delete(RATE_LIMIT_KEY.format(task=name) + ":host")


def test_a_deferred_job_takes_the_slot_recorded_for_it_once_on_an_event_loop_too(redis_server: RedisServer) -> None:
    """`acquire_async` (an async job of the asyncio pool) takes a deferred job's recorded slot as `acquire` does: once;
    the next call for that id, and any for an id with no record, asks for a slot of its own."""
    import asyncio

    from pipeline.pools import aio
    from pipeline.scheduling.ratelimit import acquire_async, record

    limit = ClusterRate("1/m")
    name = f"test.deferred-{uuid.uuid4().hex[:8]}"
    job_id = uuid.uuid4().hex
    recorded = time.time() + 0.01  # on its slot when it asks

    async def ask() -> list[tuple[float, float]]:
        try:
            return [await acquire_async(limit, name, None, None, deferred) for deferred in (job_id, job_id, "forged")]
        finally:
            await aio.close_loop_resources()

    record(limit, job_id, recorded, 0.0)
    (wait, slot), (_, fresh), (forged_wait, forged) = asyncio.run(ask())
    assert (wait, slot) == (0.0, pytest.approx(recorded, abs=0.001))  # its own slot, no other taken
    assert forged - fresh == pytest.approx(60, abs=0.001) and forged_wait > 30  # each later call took a new slot
    redis_server.client().delete(RATE_LIMIT_KEY.format(task=name))
