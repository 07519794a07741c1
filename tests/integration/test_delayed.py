"""Delayed jobs run once and on time; parked jobs cost workers no memory; long retry waits are parked."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline import lua, publish
from pipeline.broker import broker_redis, decode_message
from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY
from pipeline.scheduling.delayed import release_due
from pipeline.status import job_status
from tests.support.monitor import Monitor
from tests.support.procs import wait_for, waiting
from tests.support.worker_app import attempts, ledger

pytestmark = pytest.mark.integration

#: A worker that holds retries for at most 1 s (max of RETRY_MAX_DELAY and DELAYED_RELEASE_AHEAD).
SHORT_HOLD_ENV = {
    "TASK_SOFT_TIME_LIMIT": "1",
    "TASK_TIME_LIMIT": "2",
    "TRANSCODE_SOFT_TIME_LIMIT": "1",
    "TRANSCODE_TIME_LIMIT": "2",
    "RETRY_MAX_DELAY": "0.5",
    "DELAYED_RELEASE_AHEAD": "1",
    "DELAYED_POLL_INTERVAL": "0.2",
    "UNACKED_RESTORE_INTERVAL": "1",
}
#: How late a delayed job may start (release polling + the worker's ETA timer on a busy 2-core box).
LATE_TOLERANCE_S = 1.5


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def unpark(ids: list[str]) -> None:
    with broker_redis() as client:
        pipe = client.pipeline()
        pipe.zrem(DELAYED_KEY, *ids)
        pipe.hdel(DELAYED_MESSAGE_KEY, *ids)
        pipe.hdel(DELAYED_DEST_KEY, *ids)
        pipe.execute()


def test_parked_job_is_scheduled_and_released_as_celery_would_publish_it() -> None:
    key = f"park-{uuid.uuid4().hex}"
    task_id = ledger.enqueue({"key": key}, countdown=3600)
    try:
        assert publish.is_parked(task_id)
        status = job_status(task_id)
        assert status.state == "scheduled"
        assert status.due_at
        with broker_redis() as client:
            dest = client.hget(DELAYED_DEST_KEY, task_id)
            body = client.hget(DELAYED_MESSAGE_KEY, task_id)
        assert dest == b"default\x06\x163"  # the list of its priority: TASK_DEFAULT_PRIORITY (3)
        assert decode_message(body or b"")["properties"]["priority"] == 3
        envelope: dict[str, Any] = decode_message(body or b"")
        assert envelope["headers"]["task"] == "test.ledger"
        assert envelope["headers"]["id"] == task_id
        assert envelope["headers"]["eta"]  # the worker's timer starts it at the due time
        assert envelope["body"][0][0]["key"] == key
        assert envelope["properties"]["delivery_info"]["routing_key"] == "default"
    finally:
        unpark([task_id])
    assert not publish.is_parked(task_id)


def test_a_parked_delay_runs_exactly_once_and_on_time(make_worker: Any) -> None:
    """A held countdown is renewed like any delivery (tests/faults/test_leases.py); a parked one costs no worker."""
    make_worker("delayed-vt", env=SHORT_HOLD_ENV, queues="default", concurrency=1)
    parked_key = f"parked-{uuid.uuid4().hex}"
    delay = 12
    due = time.time() + delay
    ledger.enqueue({"key": parked_key}, countdown=delay)

    wait_for(lambda: attempts(parked_key), delay + 10, 0.05, what="the delayed job to run")
    started = attempts(parked_key)[0]["t"]
    print(f"delayed job started {started - due:+.3f}s from its due time")
    assert -0.05 <= started - due <= LATE_TOLERANCE_S, f"started {started - due:+.2f}s from its due time"
    time.sleep(3)  # room for a second release to show up; the assertion is the count below
    assert len(attempts(parked_key)) == 1


def test_five_thousand_parked_jobs_do_not_grow_worker_memory(make_worker: Any) -> None:
    worker = make_worker("delayed-mem", env=SHORT_HOLD_ENV, queues="default", concurrency=1)
    time.sleep(1)  # let the freshly started worker settle before the baseline
    before = rss_kib(worker.pid)
    ids = [ledger.enqueue({"key": f"mem-{i}", "sleep_s": 0.0}, countdown=3600) for i in range(5000)]
    try:
        assert all(publish.is_parked(i) for i in ids[::500])
        time.sleep(3)  # a dozen release polls: nothing is due, nothing reaches the worker
        after = rss_kib(worker.pid)
        with broker_redis() as client:
            assert waiting(client, "default") == 0
            assert client.zcard(DELAYED_KEY) >= 5000
        print(f"worker RSS {before} KiB -> {after} KiB with 5,000 parked jobs")
        # Held in the worker as Celery ETA requests, 5,000 such jobs grew it by ~45 MiB (measured once).
        assert after - before < 8 * 1024, f"worker RSS grew by {after - before} KiB"
    finally:
        unpark(ids)


def test_retry_longer_than_a_worker_may_hold_is_parked(make_worker: Any) -> None:
    """A worker that may hold a retry for 1 s parks a 5 s Retry-After."""
    make_worker("retry-park", env=SHORT_HOLD_ENV, queues="retry-park", concurrency=1)
    key = f"retry-after-{uuid.uuid4().hex}"
    job = {"key": key, "fail": "transient", "fail_times": 1, "retry_after": 5}
    task_id = ledger.task.apply_async((job,), queue="retry-park").id
    wait_for(lambda: publish.is_parked(task_id), 20, 0.05, what="the retry to be parked")
    # The attempt parks its retry, then its RETRY state is stored: "scheduled" until then, "retrying" after.
    wait_for(lambda: job_status(task_id).state == "retrying", 5, 0.02, what="the status to show the retry")
    wait_for(lambda: len(attempts(key)) >= 2, 30, 0.1, what="the second attempt")
    time.sleep(4)  # the parked retry must not come back twice
    first, second = attempts(key)
    assert second["t"] - first["t"] >= 5
    assert ledger.result(task_id, timeout=10).attempt == 2


@pytest.mark.usefixtures("no_background_releaser")
def test_concurrent_releasers_release_each_entry_exactly_once(redis_server: Any) -> None:
    """Four releasers racing over the same 400 due entries push each one exactly once."""
    import threading

    dest = f"test:released:{uuid.uuid4().hex}"
    ids = [f"race-{uuid.uuid4().hex}" for _ in range(400)]
    client = redis_server.client()
    pipe = client.pipeline()
    for i in ids:
        pipe.hset(DELAYED_MESSAGE_KEY, i, i)
        pipe.hset(DELAYED_DEST_KEY, i, dest)
        pipe.zadd(DELAYED_KEY, {i: time.time() - 1})
    pipe.execute()
    counts: list[int] = []

    def release() -> None:
        while (n := release_due(limit=7)) > 0:
            counts.append(n)

    threads = [threading.Thread(target=release) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        pushed = [b.decode() for b in client.lrange(dest, 0, -1)]
        assert sorted(pushed) == sorted(ids)
        assert sum(counts) >= 400  # other tests' due entries may be released too, never ours twice
        assert not any(client.zscore(DELAYED_KEY, i) for i in ids)
    finally:
        client.delete(dest)
        unpark(ids)


@pytest.mark.usefixtures("no_background_releaser")
def test_a_poll_with_nothing_due_calls_no_script_and_a_due_entry_is_released(redis_server: Any) -> None:
    """A releaser's poll reads the earliest due time and runs the release script only when an entry is due: an idle
    worker's polls cost Redis a read each."""
    dest = f"test:released:{uuid.uuid4().hex}"
    later, due = f"later-{uuid.uuid4().hex}", f"due-{uuid.uuid4().hex}"
    client = redis_server.client()
    client.hset(DELAYED_MESSAGE_KEY, mapping={later: later, due: due})
    client.hset(DELAYED_DEST_KEY, mapping={later: dest, due: dest})
    client.zadd(DELAYED_KEY, {later: time.time() + 3600})
    try:
        assert client.zrange(DELAYED_KEY, 0, 0) == [later.encode()]  # nothing else parked due sooner
        with Monitor(redis_server.client()) as seen:
            assert release_due() == 0
        # The release script's calls only: the session's worker, when this process runs one, runs scripts of its own.
        release = lua.sha("delayed_release")
        assert not [c for c in seen.commands if c["command"].upper().startswith("EVAL") and release in c["command"]]
        client.zadd(DELAYED_KEY, {due: time.time() - 1})
        assert release_due() >= 1
        assert client.lrange(dest, 0, -1) == [due.encode()] and client.zscore(DELAYED_KEY, later) is not None
    finally:
        client.delete(dest)
        unpark([later, due])


def test_a_poll_reads_redis_clock_and_the_earliest_due_time_in_one_round_trip(own_redis: Any) -> None:
    """On a single Redis a releaser's poll reads TIME and the due-time index's earliest entry in one round trip:
    Redis reads them in one read of the socket (`total_reads_processed`: the pair, then this test's INFO)."""
    from pipeline.scheduling.delayed import _calls, _clock

    client = own_redis.client()
    client.zadd(DELAYED_KEY, {"parked": 1234.5})
    reads = int(client.info("stats")["total_reads_processed"])
    now, earliest = _clock(client, _calls())
    assert int(client.info("stats")["total_reads_processed"]) - reads == 2
    assert earliest == [(b"parked", 1234.5)] and now > 1234.5


def test_cli_delay_parks_the_job_and_status_says_scheduled() -> None:
    import json

    from typer.testing import CliRunner

    from pipeline.cli.main import app as cli

    runner = CliRunner()
    enqueued = runner.invoke(cli, ["enqueue", "probe", "--set", "message=later", "--delay", "3600", "--json"])
    assert enqueued.exit_code == 0, enqueued.output
    task_id = json.loads(enqueued.output)["id"]
    try:
        shown = runner.invoke(cli, ["status", task_id, "--json"])
        status = json.loads(shown.output)
        assert status["state"] == "scheduled"
        assert status["due_at"].startswith(time.strftime("%Y-%m-%d", time.gmtime(time.time() + 3600)))
    finally:
        unpark([task_id])
