"""A test's own redis-server stopped and started again on the same port (by PID), and what the outage tests read back:
the processes they expect alive, and the `test:done:<key>` list the jobs append to."""

from __future__ import annotations

import subprocess
import time

from tests.support.procs import RedisServer

#: How long Redis stays down when a test does not say.
OUTAGE_S = 5.0


def outage(redis: RedisServer, seconds: float = OUTAGE_S) -> tuple[float, float]:
    """Stop Redis for `seconds`; the times it was surely down from (its process gone) and until (not started)."""
    redis.stop()
    down_from = time.time()
    time.sleep(seconds)  # the outage itself, not a wait for an outcome
    down_until = time.time()
    redis.start()
    return down_from, down_until


def alive(proc: subprocess.Popen[bytes] | None, pid: int) -> bool:
    return proc is not None and proc.pid == pid and proc.poll() is None


def done(redis: RedisServer, key: str) -> list[str]:
    return [x.decode() for x in redis.client().lrange(f"test:done:{key}", 0, -1)]
