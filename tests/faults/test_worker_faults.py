"""Workers dying or stopping mid-task: nothing is lost, each failure path ends done or dead-lettered.

These tests use their own workers on a queue of their own ("faults"), so the session worker never
takes their messages.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.support.dlq import dead_letter
from tests.support.procs import wait_for, waiting
from tests.support.worker_app import attempts, ledger, ledger_client

pytestmark = pytest.mark.faults
QUEUE = "faults"
#: Short time limits (a killed worker's jobs and the lease: tests/faults/test_lease_kills.py).
FAST_REDELIVERY = {
    "TASK_SOFT_TIME_LIMIT": "5",
    "TASK_TIME_LIMIT": "6",
    "TRANSCODE_SOFT_TIME_LIMIT": "5",
    "TRANSCODE_TIME_LIMIT": "6",
}


def send(limits: tuple[int, int] | None = None, **payload: Any) -> str:
    """Publish a ledger job to the faults queue. Time limits travel in the message (Celery's protocol),
    so tests that exercise them set them here, as the producer of such a job would."""
    options: dict[str, Any] = {"soft_time_limit": limits[0], "time_limit": limits[1]} if limits else {}
    return str(ledger.task.apply_async((payload,), queue=QUEUE, **options).id)


def done(key: str) -> list[bytes]:
    return list(ledger_client().lrange(f"test:done:{key}", 0, -1))


def started(key: str, n: int = 1, timeout: float = 30) -> None:
    wait_for(lambda: len(attempts(key)) >= n, timeout, 0.05, what=f"{n} start(s) of {key}")


def test_sigterm_requeues_a_long_task_within_the_soft_shutdown_bound(make_worker: Any) -> None:
    key = "sigterm-requeue"
    env = {**FAST_REDELIVERY, "WORKER_SOFT_SHUTDOWN_TIMEOUT": "2"}
    w1 = make_worker("term1", env=env, queues=QUEUE, concurrency=1)
    task_id = send(key=key, sleep_s=30, sleep_once=True)
    started(key)
    begun = time.monotonic()
    w1.send_signal(signal.SIGTERM)
    w1.wait(30)
    stopped_after = time.monotonic() - begun
    assert stopped_after < 30, stopped_after  # it did not wait its 30 s job out (no clock bound: a loaded box)
    assert done(key) == []
    assert waiting(ledger_client(), QUEUE) == 1  # requeued at once, not left for the lease to expire
    make_worker("term2", env=env, queues=QUEUE, concurrency=1)
    assert ledger.result(task_id, timeout=30).key == key
    assert len(attempts(key)) == 2 and len(done(key)) == 1


def test_sigterm_lets_a_short_task_finish(make_worker: Any) -> None:
    key = "sigterm-finish"
    w1 = make_worker("term3", env={"WORKER_SOFT_SHUTDOWN_TIMEOUT": "4"}, queues=QUEUE, concurrency=1)
    send(key=key, sleep_s=1.5)
    started(key)
    w1.send_signal(signal.SIGTERM)
    w1.wait(30)
    assert len(done(key)) == 1 and len(attempts(key)) == 1
    assert waiting(ledger_client(), QUEUE) == 0


def test_killed_pool_child_is_retried_then_dead_lettered_from_the_main_process(make_worker: Any) -> None:
    key = "child-crash"
    make_worker("crash", queues=QUEUE, concurrency=1)
    task_id = send(key=key, fail="crash")
    entry = dead_letter(task_id)
    assert entry.exception_type == "billiard.exceptions.WorkerLostError"
    assert entry.attempts == 5 and len(attempts(key)) == 5
    assert entry.queue == QUEUE and entry.payload["key"] == key


def test_soft_time_limit_fails_the_job_into_the_dlq(make_worker: Any) -> None:
    key = "soft-limit"
    make_worker("soft", queues=QUEUE, concurrency=1)
    entry = dead_letter(send((1, 4), key=key, sleep_s=10))
    assert entry.exception_type == "billiard.exceptions.SoftTimeLimitExceeded"
    assert entry.attempts == 1


def test_hard_time_limit_kill_is_dead_lettered(make_worker: Any) -> None:
    key = "hard-limit"
    make_worker("hard", queues=QUEUE, concurrency=1)
    entry = dead_letter(send((1, 2), key=key, fail="hang"))
    assert entry.exception_type == "billiard.exceptions.TimeLimitExceeded"
    assert entry.payload["key"] == key and entry.task_name == "test.ledger"


def test_time_limits_a_message_asks_for_are_capped_by_the_worker(make_worker: Any) -> None:
    """A foreign client's `send_task(..., time_limit=120)` runs under the worker's own limits (1 s soft here)."""
    key = "clamped"
    worker = make_worker(
        "clamp", env={"TASK_SOFT_TIME_LIMIT": "1", "TASK_TIME_LIMIT": "3"}, queues=QUEUE, concurrency=1
    )
    entry = dead_letter(send((60, 120), key=key, sleep_s=10))
    assert entry.exception_type == "billiard.exceptions.SoftTimeLimitExceeded"
    assert "asked for time limits hard=120 soft=60; clamped to hard=3 soft=1" in worker.log()
    assert done(key) == []
