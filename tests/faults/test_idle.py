"""What an idle worker sends its Redis, counted by kind on MONITOR (`pipeline.delivery.waking`: the fallback poll
backs off; `fetch.lua`: an empty fetch reads every key it could take from in one EXISTS; `pipeline.delivery.lapsed`:
a sweep that finds no lapsed lease takes no mutex), and a job still wakes it at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pipeline.lua import sha
from pipeline.queues.wake import WAKE_POLL_MAX_S, WAKE_POLL_S
from tests.support.monitor import Monitor
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.faults


def _waits(seen: Monitor) -> list[float]:
    """The timeouts of the worker's waits for a marker (`BLMPOP <timeout> ...`), in order."""
    return [float(c["command"].split(" ")[1]) for c in seen.commands if c["command"].startswith("BLMPOP ")]


def _sent(seen: Monitor, prefix: str) -> list[dict[str, Any]]:
    """The commands a client (not a script) sent that start with `prefix`."""
    return [c for c in seen.commands if c["client_type"] != "lua" and c["command"].startswith(prefix)]


def _inside_fetches(commands: list[dict[str, Any]]) -> list[int]:
    """How many calls each fetch script made (MONITOR logs a script, then each call it makes as it runs)."""
    counts: list[int] = []
    fetching = False
    for c in commands:
        if c["client_type"] == "lua":
            if fetching:
                counts[-1] += 1
            continue
        fetching = c["command"].startswith(f"EVALSHA {sha('fetch')}")
        if fetching:
            counts.append(0)
    return counts


def test_an_idle_worker_backs_its_poll_off_fetches_cheaply_sweeps_without_the_mutex_and_wakes_on_a_job(
    own_redis: RedisServer, work_dir: Path, producer: Celery
) -> None:
    """A prefork worker on the five work queues (20 lists with kombu's priority steps), nothing queued. While it
    stays idle: its waits for a marker double from WAKE_POLL_S to WAKE_POLL_MAX_S; each fetch script calls Redis at
    most twice (the paused set, one EXISTS over every list and its groups' keys), not two or three times per list;
    its sweeps (every second here) read the lease index's earliest entry and never take the sweep's mutex. A job
    pushed then without a marker (a stock client) runs, and the wait after it starts over at WAKE_POLL_S."""
    env = {"REDIS_URL": own_redis.url, "LEASE_SECONDS": "6", "UNACKED_RESTORE_INTERVAL": "1"}
    worker = Worker("idle", work_dir / "logs", env, concurrency=1)
    client = own_redis.client()
    try:
        with Monitor(client) as seen:
            worker.start()
            wait_for(lambda: WAKE_POLL_MAX_S in _waits(seen), 120, 0.2, what="the fallback poll at its longest")
            wait_for(lambda: len(_sent(seen, "ZRANGE unacked_index")) >= 3, 60, 0.2, what="three sweeps")
            idle = list(seen.commands)
            before = _waits(seen)
            assert producer.send_task("plain.add", args=[2, 3], queue="default").get(timeout=60) == 5
            wait_for(lambda: WAKE_POLL_S in _waits(seen)[len(before) :], 60, 0.2, what="a wait started over")
        assert before == [min(WAKE_POLL_MAX_S, WAKE_POLL_S * 2**n) for n in range(len(before))], before

        inside = _inside_fetches(idle)
        assert inside, "the idle worker never fetched"
        assert max(inside) <= 2, inside  # the paused set, one EXISTS over every key (not 2-3 calls a list)

        assert [c["command"] for c in idle if "unacked_mutex" in c["command"]] == []  # no lapsed lease: no mutex
    finally:
        worker.stop()
