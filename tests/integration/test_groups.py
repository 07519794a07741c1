"""Groups on real workers: another group's job is not stuck behind one group's backlog, and GROUP_CONCURRENCY caps
how many of one group run at once while other groups' jobs run beside them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY, GROUP_COUNT_KEY, HEADER_GROUP
from pipeline.errors import PayloadInvalid
from pipeline.runtime.asyncpool import POOL
from tests.support.api import ApiServer
from tests.support.cli import run_cli
from tests.support.procs import RedisServer, wait_for
from tests.support.worker_app import awaiting, run, run_records

pytestmark = pytest.mark.integration


def _starts(key: str) -> list[str]:
    return [r["task_id"] for r in run_records(key) if r["event"] == "start"]


def test_a_small_groups_jobs_run_before_a_big_groups_backlog(make_worker: Any, redis_server: RedisServer) -> None:
    """Typed enqueues (each group's jobs on its own list) drained by a solo worker of the I/O profile."""
    key = uuid.uuid4().hex
    big = run.enqueue_many([{"key": key, "sleep_s": 0.01} for _ in range(150)], group="big")
    small = [run.enqueue({"key": key}, group="small") for _ in range(2)]
    assert sum(int(n) for n in redis_server.client().hvals(GROUP_COUNT_KEY)) >= 152  # counted for every display
    make_worker(f"groups-{key[:6]}", pool="solo", concurrency=1)

    wait_for(lambda: set(small) <= set(_starts(key)), 30, 0.05, what="the small group's jobs")

    starts = _starts(key)
    assert max(starts.index(job) for job in small) < 12  # behind a few of big's (prefetched, then turns), not 150
    wait_for(lambda: len(_starts(key)) == len(big) + len(small), 60, 0.1, what="the backlog")
    assert sorted(_starts(key)) == sorted(big + small)  # each job ran once


def test_a_bad_group_is_refused_at_enqueue() -> None:
    for bad in ("x" * 129, "tab\there", " padded"):
        with pytest.raises(PayloadInvalid, match="group"):
            run.enqueue({"key": "never"}, group=bad)


def test_concurrency_is_capped_per_group_across_the_worker(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """Jobs sent by a plain Celery client with the group header (moved to their group by the fetch): with
    GROUP_CONCURRENCY=2 on a worker with three pool processes, at most two of group a's run at once, and b's job
    runs while a's wait."""
    env = {
        "REDIS_URL": own_redis.url,
        "TEST_LEDGER_URL": ledger_redis.url,
        "GROUP_CONCURRENCY": "2",
        "WORKER_PREFETCH_MULTIPLIER": "1",
    }
    key = uuid.uuid4().hex
    producer = Celery("groups-producer", broker=own_redis.url, set_as_current=False)
    producer.conf.update(task_serializer="json")

    def send(group: str) -> str:
        payload = {"key": key, "sleep_s": 0.6}
        return str(producer.send_task("test.run", args=[payload], queue="default", headers={HEADER_GROUP: group}).id)

    a = [send("a") for _ in range(6)]
    b = send("b")
    make_worker(f"groups-{key[:6]}", env=env, concurrency=3)
    records = ledger_redis.client()

    def ledger() -> list[dict[str, Any]]:
        return [json.loads(r) for r in records.lrange(f"test:run:{key}", 0, -1)]

    wait_for(lambda: sum(r["event"] == "finish" for r in ledger()) == 7, 60, 0.1, what="all seven jobs")
    running: set[str] = set()
    most_of_a = 0
    b_started_with_a_waiting = False
    a_started = 0
    for record in ledger():
        if record["event"] == "start":
            running.add(record["task_id"])
            a_started += record["task_id"] in a
            if record["task_id"] == b:
                b_started_with_a_waiting = a_started < len(a)
        else:
            running.discard(record["task_id"])
        most_of_a = max(most_of_a, len(running & set(a)))
    assert most_of_a == 2  # the cap, reached and never passed
    assert b_started_with_a_waiting  # a capped group does not hold the third process: b's job took it
    # The last job's acknowledgement follows its finish record (the worker's next loop iteration): every one lands.
    wait_for(lambda: own_redis.client().hlen("unacked") == 0, 10, 0.05, what="every acknowledgement")


def _most_at_once(records: list[dict[str, Any]], jobs: list[str]) -> int:
    """The most of `jobs` running at once in a `test.run` ledger (its start and finish records, in order)."""
    running: set[str] = set()
    most = 0
    for record in records:
        if record["event"] == "start":
            running.add(record["task_id"])
        else:
            running.discard(record["task_id"])
        most = max(most, len(running & set(jobs)))
    return most


@pytest.mark.parametrize(
    ("workers", "cap", "task"),
    [([("prefork", 4)], 2, run), ([("solo", 1)] * 2, 1, run), ([("custom", 20)], 2, awaiting)],
    ids=["prefork-c4-prefetch4-cap2", "two-solo-workers-cap1", "asyncio-c20-cap2"],
)
def test_the_cap_holds_when_a_group_s_jobs_come_while_its_first_ones_run(
    workers: list[tuple[str, int]], cap: int, task: Any, make_worker: Any
) -> None:
    """Pool slots to spare and room to prefetch (the I/O profile's prefetch of 4; the asyncio pool, `-P custom`, with
    20 `async def` jobs in flight): group c's first `cap` jobs run, its list empties (its state with it), and its
    next jobs arrive while those still run. Each enqueue puts c back in the ring of ready groups; the fetch checks
    the cap when it takes a job, so no more than `cap` of c's run at once, and group d's jobs take the free slots
    instead of waiting behind c's."""
    key = uuid.uuid4().hex
    for n, (pool, concurrency) in enumerate(workers):
        env = {"GROUP_CONCURRENCY": str(cap), **({"CELERY_CUSTOM_WORKER_POOL": POOL} if pool == "custom" else {})}
        make_worker(f"cap-{n}-{key[:6]}", env=env, pool=pool, concurrency=concurrency)
    job = {"key": key, "sleep_s": 0.6}
    c = [task.enqueue(job, group="c") for _ in range(cap)]
    wait_for(lambda: len(_starts(key)) == cap, 30, 0.02, what="group c's first jobs")
    c += [task.enqueue(job, group="c") for _ in range(4)]
    d = [task.enqueue(job, group="d") for _ in range(2)]

    every = len(c) + len(d)
    wait_for(lambda: sum(r["event"] == "finish" for r in run_records(key)) == every, 60, 0.05, what="every job")
    records = run_records(key)
    assert _most_at_once(records, c) == cap, records  # the cap, reached and never passed
    starts = _starts(key)
    assert max(starts.index(job) for job in d) < starts.index(c[-1])  # d's jobs ran beside c's, not behind them
    assert sorted(starts) == sorted(c + d)  # each job ran once


def _parked_headers(client: Any, task_id: str) -> dict[str, Any]:
    """The headers of a parked (delayed) job's message; the job is taken out of Redis (nothing consumes it)."""
    raw = client.hget(DELAYED_MESSAGE_KEY, task_id)
    client.zrem(DELAYED_KEY, task_id)
    client.hdel(DELAYED_MESSAGE_KEY, task_id)
    client.hdel(DELAYED_DEST_KEY, task_id)
    assert raw is not None
    headers: dict[str, Any] = json.loads(raw)["headers"]
    return headers


def test_the_cli_takes_a_group_and_refuses_a_bad_one(redis_server: RedisServer) -> None:
    done = run_cli("enqueue", "test-run", '{"key": "cli-group"}', "--group", "tenant-42", "--delay", "3600", "--json")
    assert done.returncode == 0, done.stderr
    task_id = json.loads(done.stdout)["id"]
    assert _parked_headers(redis_server.client(), task_id)[HEADER_GROUP] == "tenant-42"  # kept through the delay

    refused = run_cli("enqueue", "test-run", '{"key": "cli-group"}', "--group", "x" * 129)
    assert refused.returncode == 2 and "group" in refused.stderr + refused.stdout


def test_the_api_takes_a_group_and_refuses_a_bad_one(redis_server: RedisServer, work_dir: Path) -> None:
    server = ApiServer("groups", work_dir / "logs").start()
    try:
        with server.client() as client:
            accepted = client.post("/jobs/probe?group=tenant-7&delay_seconds=3600", json={"message": "grouped"})
            assert accepted.status_code == 202, accepted.text
            assert _parked_headers(redis_server.client(), accepted.json()["id"])[HEADER_GROUP] == "tenant-7"
            too_long = client.post(f"/jobs/probe?group={'x' * 129}", json={"message": "never"})
            assert too_long.status_code == 422 and "group" in too_long.text
            batch = client.post("/jobs/probe/batch?group=%09tab", json=[{"message": "never"}])
            assert batch.status_code == 422 and "group" in batch.text
    finally:
        server.stop()
