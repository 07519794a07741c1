"""Celery's own API on the pipeline's worker, used by a stock Celery app (issue 42): a job it publishes (kombu's plain
Redis transport: no wake-up marker) wakes the waiting worker at once, `.get()` returns as the result is stored, and
results live where RESULT_BACKEND_URL says (another database, another server) on every pool, fenced by the lease on
the broker's Redis.

Each test starts one real worker (`celery -A tests.support.worker_app worker`) on a broker of its own (a throwaway
redis-server) with a fallback poll of a minute (`TEST_WAKE_POLL_S`, `tests.support.plain_tasks`): a job that finishes
within the test's 20 s was woken, not polled. The client is a stock Celery app on the same broker and the result
backend the worker was given; it waits with `get(interval=30)`, so a result it did not hear published (Celery's
Redis backend subscribes to the task's key) or could not read where it looks would take 30 s and fail the 20 s.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery, chain

from pipeline.constants import LEASE_KEY
from pipeline.runtime.asyncpool import POOL
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.integration

#: The pools a worker runs: prefork, solo and the asyncio pool (`-P custom`, what `pipeline worker` runs).
POOLS: dict[str, dict[str, str]] = {"prefork": {}, "solo": {}, "custom": {"CELERY_CUSTOM_WORKER_POOL": POOL}}
#: Well within the fallback poll (60 s) and below `get`'s interval (30 s).
TIMEOUT_S = 20
FENCED = "not stored: this worker lost the job's lease"


@pytest.fixture
def other_redis(work_dir: Path) -> Iterator[RedisServer]:
    """A second throwaway redis-server: the result backend on another server."""
    server = RedisServer(work_dir / f"results-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()


def _result_url(layout: str, broker: RedisServer, other: RedisServer) -> str:
    return broker.url.rsplit("/", 1)[0] + "/1" if layout == "db" else other.url


def _start(make_worker: Callable[..., Worker], pool: str, broker: RedisServer, result_url: str, queue: str) -> Worker:
    env = {**POOLS[pool], "REDIS_URL": broker.url, "RESULT_BACKEND_URL": result_url, "TEST_WAKE_POLL_S": "60"}
    return make_worker(f"api-{pool}-{queue[-6:]}", env=env, pool=pool, concurrency=2, queues=queue)


def _stock(broker: RedisServer, result_url: str) -> Celery:
    """A stock Celery app: nothing of the pipeline (kombu's own transport, Celery's own Redis backend)."""
    return Celery("stock-client", broker=broker.url, backend=result_url)


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("layout", ["db", "server"])
def test_a_stock_app_wakes_the_worker_and_reads_results_where_the_backend_says(
    make_worker: Callable[..., Worker], own_redis: RedisServer, other_redis: RedisServer, layout: str, pool: str
) -> None:
    queue = f"api-{uuid.uuid4().hex[:8]}"
    result_url = _result_url(layout, own_redis, other_redis)
    worker = _start(make_worker, pool, own_redis, result_url, queue)
    client = _stock(own_redis, result_url)
    try:
        single = client.send_task("plain.add", args=[1, 2], queue=queue)
        assert single.get(timeout=TIMEOUT_S, interval=30) == 3
        steps = [client.signature("plain.add", args=(1, 1), queue=queue)]
        steps += [client.signature("plain.add", args=(1,), queue=queue) for _ in range(2)]
        chained = chain(*steps).apply_async()
        assert chained.get(timeout=TIMEOUT_S, interval=30) == 4
        assert client.AsyncResult(single.id).state == "SUCCESS"  # read back from the backend's own Redis
    finally:
        client.close()
    keys = [f"celery-task-meta-{task_id}" for task_id in (single.id, chained.id)]
    broker = own_redis.client()  # database 0: the broker's
    assert broker.exists(*keys) == 0, "a result was written on the broker's database"
    assert redis.Redis.from_url(result_url, socket_timeout=5).exists(*keys) == 2
    assert FENCED not in worker.log()


@pytest.mark.parametrize("pool", ["prefork", "custom"])
def test_a_result_elsewhere_is_fenced_by_the_lease_on_the_brokers_redis(
    make_worker: Callable[..., Worker], own_redis: RedisServer, other_redis: RedisServer, pool: str
) -> None:
    """The job's lease taken over by another worker while it runs (as a sweep hands it to a peer): its result is not
    stored on the result backend's server."""
    queue = f"api-{uuid.uuid4().hex[:8]}"
    worker = _start(make_worker, pool, own_redis, other_redis.url, queue)
    client = _stock(own_redis, other_redis.url)
    broker = own_redis.client()
    try:
        job = client.send_task("plain.sleep", args=[3], queue=queue)
        wait_for(lambda: broker.hlen(LEASE_KEY) == 1, TIMEOUT_S, 0.05, what="the job to be leased")
        (tag,) = broker.hkeys(LEASE_KEY)
        broker.hset(LEASE_KEY, tag, "another-worker")
        wait_for(lambda: FENCED in worker.log(), 30, 0.2, what="the result to be fenced")
    finally:
        client.close()
    assert other_redis.client().exists(f"celery-task-meta-{job.id}") == 0
