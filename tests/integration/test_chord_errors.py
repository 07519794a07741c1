"""A chord whose header fails: the order its results are stored in, and what `AsyncResult.get()` raises.

Celery's `AsyncResult.get()` of a chord raises the first failure in the canvas: the header task's own error, not the
`ChordError` Celery stores on the body for it. It reads the header's results (`_maybe_reraise_parent_error`) before it
waits, and after each wait (`on_interval`). That needs the worker to store a failed header task's FAILURE before
`on_chord_part_return` stores the body's `ChordError` (Celery's `Backend.mark_as_failure` stores first; so does its
`_fail_chain` for a chain's later steps), on every pool. The first tests check that order on prefork and on the
asyncio pool, with every message the result backend publishes.

The last ones hold the client between its first read of the header and its own read of the body (as a client
descheduled on a loaded machine is held) until the worker stored both. Celery 5.7 waits `while not p.ready`
(`Drainer.drain_events_until`): a result found final at its first read runs no wait and no check, and stock Celery's
`get()` then raises the `ChordError`. The pipeline's result backend checks once more (`pipeline.compat.resultwait`).

Each test starts one real worker (`celery -A tests.support.worker_app worker`) on a queue of its own.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, signature
from celery.canvas import Signature
from celery.exceptions import ChordError
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.runtime.asyncpool import POOL
from tests.support.plain_tasks import ExpectedFailure
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.integration

#: prefork, and the asyncio pool (`-P custom`, what `pipeline worker` runs).
POOLS: dict[str, dict[str, str]] = {"prefork": {}, "custom": {"CELERY_CUSTOM_WORKER_POOL": POOL}}
TIMEOUT_S = 20
META = "celery-task-meta-"


def _worker(make_worker: Callable[..., Worker], pool: str) -> str:
    queue = f"chord-{uuid.uuid4().hex[:8]}"
    make_worker(f"chord-{pool}-{queue[-4:]}", env=POOLS[pool], pool=pool, concurrency=1, queues=queue)
    return queue


def _sig(name: str, queue: str, *args: Any, immutable: bool = False) -> Signature[Any]:
    return signature(f"plain.{name}", args=args, queue=queue, immutable=immutable, app=get_app())


def _header(kind: str, queue: str) -> list[Signature[Any]]:
    """A chord header that fails: one task, a chain failing before its end, or a failing task beside two others."""
    if kind == "task":
        return [_sig("fail", queue)]
    if kind == "chain":
        steps = (_sig("identity", queue, 42, immutable=True), _sig("fail", queue), _sig("identity", queue, 42))
        return [chain(*steps)]
    return [_sig("add", queue, 1, 2), _sig("add", queue, 3, 4), _sig("fail", queue)]


def _published(pubsub: Any, until: str) -> list[dict[str, Any]]:
    """Every state the result backend published, in order, up to and including the first one of task `until`."""
    seen: list[dict[str, Any]] = []
    wait_for(lambda: _read(pubsub, seen, until), TIMEOUT_S, 0, what=f"the result of {until} to be published")
    return seen


def _read(pubsub: Any, seen: list[dict[str, Any]], until: str) -> bool:
    message = pubsub.get_message(timeout=0.2)
    if message and message["type"] == "pmessage":
        seen.append(json.loads(message["data"]))
    return any(meta["task_id"] == until for meta in seen)


@pytest.mark.parametrize("pool", list(POOLS))
def test_a_failed_header_tasks_failure_is_stored_before_the_chords_error(
    make_worker: Callable[..., Worker], redis_server: RedisServer, pool: str
) -> None:
    queue = _worker(make_worker, pool)
    client = redis_server.client()
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(f"{META}*")
    for kind in ("task", "chain", "beside", "task", "chain", "beside"):
        result = chord(_header(kind, queue), _sig("identity", queue)).apply_async()
        header_ids = [part.id for part in result.parent.results]
        published = _published(pubsub, result.id)
        body = published[-1]
        assert body["status"] == "FAILURE" and body["result"]["exc_type"] == "ChordError", kind
        # The header's part failed, was published before the body's error, and is what its key holds now.
        failed = [meta for meta in published if meta["task_id"] in header_ids and meta["status"] == "FAILURE"]
        assert [meta["result"]["exc_type"] for meta in failed] == ["ExpectedFailure"], kind
        stored = json.loads(client.get(f"{META}{failed[0]['task_id']}") or b"{}")
        assert stored["status"] == "FAILURE", kind
        with pytest.raises(ExpectedFailure):
            result.get(timeout=TIMEOUT_S)
    pubsub.close()


@contextmanager
def _held_before_own_read(app: Celery, task_id: str, then: Callable[[], None]) -> Iterator[None]:
    """`AsyncResult.get()` of `task_id` on `app` runs `then` between its read of the result's parents and its own
    read (`add_pending_result` comes between the two)."""
    backend = app.backend
    add = backend.add_pending_result

    def held(result: AsyncResult[Any], *args: Any, **kwargs: Any) -> Any:
        if result.id == task_id:
            then()
        return add(result, *args, **kwargs)

    backend.add_pending_result = held  # type: ignore[method-assign]  # this instance, for this test
    try:
        yield
    finally:
        del backend.add_pending_result


def _held_get(app: Celery, queue: str, client: redis.Redis) -> None:
    """A chord whose header task fails once the client read it unfinished, its `ChordError` stored before the client
    reads the body: `get()` raises what the client's backend raises."""
    gate = f"test:gate:{uuid.uuid4().hex}"
    header = signature("plain.fail_after", args=(gate,), queue=queue, app=app)
    result = chord([header], signature("plain.identity", queue=queue, app=app)).apply_async()

    def fail_the_header_and_wait_for_the_chords_error() -> None:
        assert AsyncResult(result.parent.results[0].id, app=app).state == "PENDING"  # the client read it unfinished
        client.set(gate, 1, ex=60)
        wait_for(lambda: client.exists(f"{META}{result.id}"), TIMEOUT_S, 0.01, what="the chord's error")

    with _held_before_own_read(app, result.id, fail_the_header_and_wait_for_the_chords_error):
        result.get(timeout=TIMEOUT_S)


def test_get_raises_the_header_tasks_error_when_the_chords_error_was_stored_between_its_reads(
    make_worker: Callable[..., Worker], redis_server: RedisServer
) -> None:
    queue = _worker(make_worker, "prefork")
    with pytest.raises(ExpectedFailure):
        _held_get(get_app(), queue, redis_server.client())


@pytest.mark.parity
def test_stock_celerys_get_raises_the_chords_error_there(
    make_worker: Callable[..., Worker], redis_server: RedisServer
) -> None:
    """Upstream's behaviour the pipeline's backend corrects (`pipeline.compat.resultwait`): when this fails, a Celery
    upgrade checks the parents itself, and the correction can go."""
    queue = _worker(make_worker, "prefork")
    stock = Celery("stock-client", broker=redis_server.url, backend=redis_server.url)
    with pytest.raises(ChordError):
        _held_get(stock, queue, redis_server.client())
