"""A cluster-wide limit of 20/s holds across 4 worker processes; throttled jobs are deferred, not failed."""

from __future__ import annotations

import bisect
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from pipeline.app import app
from pipeline.constants import RATE_LIMIT_KEY
from pipeline.ratelimit import ClusterLimit, parse_rate
from tests.support.limited import limited, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.integration

JOBS = 200
RATE = 20


def max_in_any_window(times: list[float], width: float = 1.0) -> int:
    """The most starts inside any window [t, t + width) beginning at a start."""
    return max(bisect.bisect_left(times, t + width) - i for i, t in enumerate(times))


def test_parse_rate() -> None:
    assert parse_rate("20/s") == 0.05
    assert parse_rate("120/m") == 0.5
    with pytest.raises(ValueError, match="N/s"):
        ClusterLimit("20 per second")


def test_limit_holds_across_four_processes_and_nothing_fails(
    make_worker: Any, redis_server: RedisServer, clean_dlq: None
) -> None:
    redis_server.client().delete(RATE_LIMIT_KEY.format(task="test.limited"))
    make_worker("rate-a", queues="default", concurrency=2)
    make_worker("rate-b", queues="default", concurrency=2)
    key = uuid.uuid4().hex
    ids = [limited.enqueue({"key": key, "n": i}) for i in range(JOBS)]

    wait_for(lambda: len(starts(key)) >= JOBS, JOBS / RATE + 40, 0.2, what=f"{JOBS} rate-limited jobs")
    results = [limited.result(task_id, timeout=30) for task_id in ids]
    times = starts(key)

    assert len(times) == JOBS  # each job ran once
    peak = max_in_any_window(times)
    rel = [round(t - times[0], 2) for t in times]
    print(f"peak {peak} starts/s over {times[-1] - times[0]:.1f}s")
    assert peak <= RATE * 1.1, f"{peak} starts in one second: {rel}"
    assert times[-1] - times[0] >= (JOBS - 1) / RATE - 1  # the limit, not the workers, set the pace
    assert all(r.attempt == 1 for r in results), "a throttled job was counted as a failed attempt"
    assert all(AsyncResult(i, app=app).state == "SUCCESS" for i in ids)
    assert redis_server.client().llen("dead_letter") == 0
