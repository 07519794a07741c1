"""A job whose run takes its whole worker down is delivered at most MAX_DELIVERIES times, then dead-lettered.

Each delivery of `fail="kill_worker"` SIGKILLs the worker's main process (as an out-of-memory kill of the whole
worker would); its lease lapses and a live peer's sweep puts the message back. Celery's `retries` never moves
(no attempt ended), so only the delivery count the transport keeps can stop the loop.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.status import JobState, job_status
from tests.support.cli import run_cli
from tests.support.dlq import dead_letter
from tests.support.procs import Worker, wait_for, waiting
from tests.support.worker_app import attempts, ledger, ledger_client

pytestmark = pytest.mark.faults
QUEUE = "faults-deliveries"
MAX_DELIVERIES = 3
ENV = {"LEASE_SECONDS": "5", "MAX_DELIVERIES": str(MAX_DELIVERIES)}


def test_a_worker_killing_job_is_dead_lettered_after_max_deliveries(make_worker: Any, work_dir: Path) -> None:
    key = uuid.uuid4().hex
    make_worker("lease-sweeper", env=ENV, queues="faults-idle", concurrency=1)  # restores lapsed leases
    victims: list[Worker] = []
    try:
        for n in range(1, MAX_DELIVERIES + 1):
            victim = Worker(f"victim{n}", work_dir / "logs", ENV, queues=QUEUE, concurrency=1)
            victims.append(victim)
            with contextlib.suppress(RuntimeError):  # it may take the job, and die, before it logs "ready"
                victim.start()
            if n == 1:
                task_id = str(ledger.task.apply_async(({"key": key, "fail": "kill_worker"},), queue=QUEUE).id)
            wait_for(lambda: victim.proc is not None and victim.proc.poll() is not None, 60, 0.1, what=f"delivery {n}")  # noqa: B023
            assert len(attempts(key)) == n
        make_worker("survivor", env=ENV, queues=QUEUE, concurrency=1)
        entry = dead_letter(task_id, timeout=60)
    finally:
        for victim in victims:
            victim.stop()
    assert entry.reason == "delivery_limit" and entry.exception_type == "pipeline.errors.DeliveryLimitExceeded"
    assert entry.attempts == MAX_DELIVERIES + 1 and entry.payload == {"key": key, "fail": "kill_worker"}
    workers = [d["worker"] for d in entry.deliveries]
    assert len(workers) == MAX_DELIVERIES + 1
    assert [w.split("@")[0] for w in workers] == [f"victim{n}" for n in range(1, MAX_DELIVERIES + 1)] + ["survivor"]
    assert len(attempts(key)) == MAX_DELIVERIES  # the last delivery did not run
    assert job_status(task_id).state is JobState.DEAD_LETTERED
    broker = ledger_client()  # the broker's Redis
    # Acknowledged: neither held nor queued any more, so it never comes back.
    wait_for(lambda: not any(task_id.encode() in raw for raw in broker.hvals("unacked")), 10, 0.1, what="the ack")
    assert waiting(broker, QUEUE) == 0
    shown = run_cli("dlq", "show", task_id).stdout
    assert "delivery_limit" in shown and all(f"{n}. " in shown and f"victim{n}@" in shown for n in (1, 2, 3))
