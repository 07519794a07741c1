"""Celery's control replies are never leased: a worker that starts beside another syncs with it (mingle), and the
reply it reads from `reply.celery.pidbox` is neither held in `unacked` nor counted as a job in flight."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.constants import LEASE_KEY
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.faults


def test_a_worker_syncing_with_a_running_one_holds_no_lease_on_its_reply(
    own_redis: RedisServer, work_dir: Path
) -> None:
    env = {"REDIS_URL": own_redis.url, "LEASE_SECONDS": "5"}
    first = Worker("mingle-a", work_dir / "logs", env, mingle=True, concurrency=1)
    second = Worker("mingle-b", work_dir / "logs", env, mingle=True, concurrency=1)
    try:
        first.start()
        second.start()
        wait_for(lambda: "sync with 1 nodes" in second.log(), 30, 0.1, what="the second worker's sync with the first")
        client = own_redis.client()
        time.sleep(2.5)  # past the first renewal of a 5 s lease (every 1.7 s): a held reply would be renewed
        assert client.hgetall("unacked") == {}, "a control reply was recorded as a job in flight"
        assert client.hgetall(LEASE_KEY) == {}
        assert client.zcard("unacked_index") == 0
    finally:
        second.stop()
        first.stop()
