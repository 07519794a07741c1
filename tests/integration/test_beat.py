"""Two beats against one Redis: each slot fires exactly once, and the standby takes over a killed leader."""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.constants import BEAT_KEY_PREFIX
from tests.support.beat import Beat
from tests.support.procs import RedisServer, wait_for
from tests.support.ticks import ticks

pytestmark = pytest.mark.integration

EVERY = 2.0
LOCK_TIMEOUT = 3
BEAT_ENV = {"BEAT_LOCK_TIMEOUT": str(LOCK_TIMEOUT), "BEAT_MAX_LOOP_INTERVAL": "1"}


@pytest.fixture
def beats(work_dir: Path, redis_server: RedisServer) -> Iterator[list[Beat]]:
    started: list[Beat] = []
    yield started
    for beat in started:
        beat.stop()
    client = redis_server.client()
    keys = list(client.scan_iter(match=f"{BEAT_KEY_PREFIX}*"))
    if keys:
        client.delete(*keys)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_two_beats_fire_each_slot_once_and_the_standby_takes_over(
    beats: list[Beat], session_worker: Any, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    entry = f"test-tick-{key[:8]}"
    schedule = {entry: {"task": "test.tick", "every": EVERY, "payload": {"key": key}}}
    env = {**BEAT_ENV, "BEAT_SCHEDULE": json.dumps(schedule)}

    leader = Beat(f"a-{key[:6]}", work_dir / "logs", env).start()
    beats.append(leader)
    wait_for(lambda: "beat: Acquired lock" in leader.log(), 30, 0.1, what="the first beat to take the lock")
    standby = Beat(f"b-{key[:6]}", work_dir / "logs", env).start()
    beats.append(standby)
    wait_for(lambda: len(ticks(key)) >= 1, 20, 0.1, what="the first tick")

    # Phase 1: both beats alive for five slots. The standby waits on the lock and sends nothing.
    wait_for(lambda: len(ticks(key)) >= 6, 6 * EVERY + 10, 0.1, what="six ticks")
    fired = ticks(key)
    assert min(gaps(fired)) > EVERY / 2, f"a slot fired twice: gaps {gaps(fired)}"
    assert standby.sent(entry) == 0
    assert "beat: Acquired lock" not in standby.log()

    # Phase 2: the leader dies without releasing its lock; the standby takes over within the lease.
    killed_at = time.time()
    leader.kill()
    before = len(ticks(key))
    wait_for(lambda: len(ticks(key)) >= before + 4, LOCK_TIMEOUT + 4 * EVERY + 15, 0.1, what="ticks after takeover")
    after = [t for t in ticks(key) if t > killed_at]
    assert after[0] - killed_at < LOCK_TIMEOUT + EVERY + 3, f"takeover took {after[0] - killed_at:.1f}s"
    assert "beat: Acquired lock" in standby.log()
    assert standby.sent(entry) >= 4
    everything = ticks(key)
    assert min(gaps(everything)) > EVERY / 2, f"a slot fired twice: gaps {gaps(everything)}"


def test_artifact_purge_removes_outputs_past_their_age(session_worker: Any) -> None:

    from pipeline.storage import LocalStorage, get_storage
    from tasks.housekeeping import artifact_purge

    storage = get_storage()
    assert isinstance(storage, LocalStorage)  # the tests' STORAGE_BACKEND
    prefix = f"purge-test-{uuid.uuid4().hex}"
    for name in ("old.pdf", "new.pdf"):
        with storage.open_write(f"{prefix}/{name}") as out:
            out.write(b"%PDF")
    month_ago = time.time() - 31 * 86400
    os.utime(storage.path(f"{prefix}/old.pdf"), (month_ago, month_ago))

    result = artifact_purge.result(artifact_purge.enqueue({}), timeout=30)
    assert result.removed >= 1
    assert [o.key for o in storage.list(prefix)] == [f"{prefix}/new.pdf"]
    storage.delete(f"{prefix}/new.pdf")
