"""Redis stopped and restarted under beat and a worker: both HA beats stay up, ticks resume, no slot fires twice, parked
delayed jobs are released once; a beat started while Redis is down waits for it.

Each test runs its own redis-server (AOF on), stopped and started again on the same port by PID
(`tests.faults.redis_outage`), so the session's Redis and worker never see the outage. Outages last a few seconds here;
nothing in the code depends on their length.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.constants import DELAYED_KEY
from tests.faults.redis_outage import alive, done, outage
from tests.support.beat import Beat
from tests.support.procs import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.faults

EVERY = 2.0
BEAT_ENV = {"BEAT_LOCK_TIMEOUT": "3", "BEAT_MAX_LOOP_INTERVAL": "1"}


def ticks(redis: RedisServer, key: str) -> list[float]:
    return [float(x) for x in redis.client().lrange(f"test:tick:{key}", 0, -1)]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def park(redis: RedisServer, key: str, countdowns: list[float]) -> list[str]:
    """Enqueue ledger jobs with these countdowns through the pipeline's own `enqueue` (so they are parked)."""
    code = (
        "import json, sys\n"
        "from tests.support.worker_app import ledger\n"
        "ids = [ledger.enqueue({'key': sys.argv[1]}, countdown=float(c)) for c in sys.argv[2:]]\n"
        "print('IDS ' + json.dumps(ids))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, key, *map(str, countdowns)],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis.url},
        capture_output=True,
        check=True,
        timeout=60,
    )
    line = next(x for x in out.stdout.decode().splitlines() if x.startswith("IDS "))
    return [str(i) for i in json.loads(line[4:])]


def test_two_beats_and_a_worker_survive_a_redis_restart(
    own_redis: RedisServer, make_worker: Any, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    entry = f"test-tick-{key[:8]}"
    schedule = {entry: {"task": "test.tick", "every": EVERY, "payload": {"key": key}}}
    env = {"REDIS_URL": own_redis.url, **BEAT_ENV}
    worker = make_worker(f"beat-outage-{key[:6]}", env=env)
    beat_env = {**env, "BEAT_SCHEDULE": json.dumps(schedule)}
    beat = Beat(f"outage-a-{key[:6]}", work_dir / "logs", beat_env).start()
    standby = Beat(f"outage-b-{key[:6]}", work_dir / "logs", beat_env)
    try:
        wait_for(lambda: "beat: Acquired lock" in beat.log(), 30, 0.1, what="the first beat to take the lock")
        standby.start()
        beat_pid, standby_pid, worker_pid = beat.pid, standby.pid, worker.pid
        wait_for(lambda: len(ticks(own_redis, key)) >= 3, 30, 0.1, what="three ticks before the outage")
        assert standby.sent(entry) == 0

        # Parked jobs: the first fall due during the outage, the rest after it.
        parked = park(own_redis, key, [3.0 + i for i in range(10)])
        assert own_redis.client().zcard(DELAYED_KEY) >= 5, "the jobs were parked, not published"
        stopped_at = time.time()
        down_from, down_until = outage(own_redis)
        restarted_at = time.time()

        wait_for(
            lambda: [t for t in ticks(own_redis, key) if t > restarted_at][2:],
            EVERY * 3 + 15,
            0.1,
            what="three ticks after the restart",
        )
        first_after = min(t for t in ticks(own_redis, key) if t > restarted_at)
        assert first_after - restarted_at < 8, f"ticks resumed {first_after - restarted_at:.1f}s after the restart"
        wait_for(lambda: set(parked) <= set(done(own_redis, key)), 45, 0.1, what="every parked job to run")

        assert alive(beat.proc, beat_pid), f"beat exited:\n{beat.log()[-3000:]}"
        assert alive(standby.proc, standby_pid), f"the standby beat exited:\n{standby.log()[-3000:]}"
        assert alive(worker.proc, worker_pid), f"worker exited:\n{worker.log()[-3000:]}"
        assert "Redis error in a tick" in beat.log() + standby.log()  # they did see the outage
        fired = ticks(own_redis, key)
        assert min(gaps(fired)) > EVERY / 2, f"a slot fired twice: gaps {gaps(fired)} (outage at {stopped_at})"
        assert not [t for t in fired if down_from < t < down_until], "a tick ran while Redis was down"
        runs = collections.Counter(done(own_redis, key))
        assert {job: n for job, n in runs.items() if n != 1} == {}, "a parked job ran twice"
        assert own_redis.client().zcard(DELAYED_KEY) == 0
    finally:
        beat.stop()
        standby.stop()


def test_a_beat_started_while_redis_is_down_waits_for_it(
    own_redis: RedisServer, make_worker: Any, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    schedule = {f"test-tick-{key[:8]}": {"task": "test.tick", "every": EVERY, "payload": {"key": key}}}
    env = {"REDIS_URL": own_redis.url, **BEAT_ENV}
    own_redis.stop()
    beat = Beat(f"down-at-start-{key[:6]}", work_dir / "logs", {**env, "BEAT_SCHEDULE": json.dumps(schedule)})
    try:
        beat.start()
        pid = beat.pid
        wait_for(lambda: "Redis unreachable at start" in beat.log(), 60, 0.1, what="beat to wait for Redis")
        assert alive(beat.proc, pid), f"beat exited:\n{beat.log()[-3000:]}"
        own_redis.start()
        make_worker(f"down-at-start-{key[:6]}", env=env)
        wait_for(lambda: len(ticks(own_redis, key)) >= 2, 30, 0.1, what="ticks once Redis is up")
        assert alive(beat.proc, pid)
    finally:
        beat.stop()
