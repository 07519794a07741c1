"""An urgent job behind a backlog: from its enqueue to its start, with priority 0 and with the default one.

N jobs (default 20,000) of `bench.noop` are queued at the default priority (TASK_DEFAULT_PRIORITY), two solo
pipeline workers start draining them, and once they are busy one job is enqueued with priority 0; later, while
the backlog still drains, one more at the default priority. Each records its enqueue-to-start time
(`bench.job`); the table also shows how many backlog jobs were still waiting when the urgent one started.
Not a test: nothing is asserted.

    python -m bench priority_overtake          (or python -m bench.priority_overtake [N] [PREFETCH])
"""

from __future__ import annotations

import os
import sys
import time

import redis

from bench import job
from bench.procs import Workers, bench_env, redis_server

WORKER = [sys.executable, "-m", "celery", "-A", "bench.pipeline_app", "worker", "-Q", "bench-pipeline", "-P", "solo"]
WORKER += ["--without-gossip", "--without-mingle", "-l", "WARNING"]


def _wait(client: redis.Redis, key: str, workers: Workers, timeout: float = 600) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = client.lindex(key, 0) if key.endswith(":lat") else client.get(key)
        if value is not None:
            return bytes(value)
        workers.check()
        time.sleep(0.002)
    raise RuntimeError(f"nothing at {key} after {timeout} s")


def measure(url: str, n: int, prefetch: int | None = None) -> dict[str, float]:
    from bench.pipeline_app import noop

    client = redis.Redis.from_url(url)
    client.flushdb()
    noop.enqueue_many([job.payload("backlog")] * n)
    env = bench_env(url)
    if prefetch:
        env["WORKER_PREFETCH_MULTIPLIER"] = str(prefetch)
    workers = Workers([WORKER, WORKER], env).start()
    try:
        backlog = job.keys("backlog")
        while int(client.get(backlog["done"]) or 0) < min(1000, n // 4):  # both workers busy with the backlog
            workers.check()
            time.sleep(0.01)
        noop.enqueue(job.payload("urgent", time.time()), priority=0)
        urgent = float(_wait(client, job.keys("urgent")["lat"], workers))
        behind = n - int(client.get(backlog["done"]) or 0)
        noop.enqueue(job.payload("default", time.time()))
        default = float(_wait(client, job.keys("default")["lat"], workers))
        drained = float(_wait(client, backlog["last"], workers)) - float(client.get(backlog["first"]) or 0)
    finally:
        workers.stop()
    return {"urgent_s": urgent, "backlog_left": behind, "default_s": default, "drain_jobs_per_s": n / drained}


def main(n: int = 20_000, prefetch: int | None = None) -> None:
    result = measure(os.environ["REDIS_URL"], n, prefetch)
    print(f"{n} queued at the default priority, 2 solo workers (prefetch {prefetch or 'of the profile: 4'})")
    print(f"  priority 0 started {result['urgent_s'] * 1000:.1f} ms after its enqueue")
    print(f"    with {result['backlog_left']:.0f} backlog jobs still waiting then")
    print(f"  default priority started {result['default_s']:.2f} s after its enqueue (behind the backlog)")
    print(f"  backlog drained at {result['drain_jobs_per_s']:.0f} jobs/s")


if __name__ == "__main__":
    with redis_server() as server:
        os.environ.update(REDIS_URL=server, ENV_FILE="", SECRETS_DIR="/nonexistent", LOG_LEVEL="WARNING")
        main(*(int(a) for a in sys.argv[1:3]))
