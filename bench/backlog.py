"""Whether the embedded Redis slows with the backlog: a 200,000-job backlog drained against a 20,000-job one.

On the server `pipeline run` would start (`pipeline.cli.redis_bin`; put another build first on PATH as
`redis-server` to measure it), with the local stack's persistence (AOF, fsync every second). Per rep and backlog:
N jobs queued by `enqueue_many` in batches of 1,000 (`bench.producer`), then three solo workers started; the rate
is over 15,000 jobs after the first 500 (boot excluded), from the jobs' own records (`bench.job`); the server's
cost per call of the fetch script (EVALSHA) and of RPOP over the same span, from INFO commandstats. The backlogs
alternate per rep; medians printed with the ratio the issue asks for (200,000 against 20,000, target >= 0.8).

    python -m bench backlog            (or `python -m bench.backlog [REPS]`, default 3)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import redis

from bench import job
from bench.procs import Workers, bench_env, redis_server, run_producer
from pipeline.cli.redis_bin import redis_server_binary

BACKLOGS = (20_000, 200_000)
WORKERS, SKIP, MEASURED = 3, 500, 15_000
#: The local stack's persistence (pipeline/cli/stack.py): AOF, fsync every second.
STACK_OPTIONS = ("--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction")


def drain(backlog: int) -> dict[str, float]:
    """One measurement on a server of its own: jobs/s and the server's usec per fetch and per RPOP."""
    with redis_server(*STACK_OPTIONS) as url:
        client, env, run = redis.Redis.from_url(url), bench_env(url), uuid.uuid4().hex[:12]
        run_producer(env, "pipeline", "batches", backlog // 1000, 1000, run)
        celery = os.path.join(os.path.dirname(sys.executable), "celery")
        argv = [celery, "-A", "bench.pipeline_app", "worker", "-Q", "bench-pipeline", "-P", "solo", "-l", "WARNING"]
        workers = Workers([[*argv, "-n", f"backlog{i}@%h"] for i in range(WORKERS)], env).start()
        done = job.keys(run)["done"]

        def reached(count: int) -> tuple[float, int]:
            deadline = time.monotonic() + 600
            while int(client.get(done) or 0) < count:
                workers.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{client.get(done)!r} of {count} jobs done")
                time.sleep(0.01)
            return time.monotonic(), int(client.get(done) or 0)

        try:
            reached(SKIP)
            client.config_resetstat()
            (began, first), (ended, last) = reached(SKIP), reached(SKIP + MEASURED)
            stats = client.info("commandstats")
        finally:
            workers.stop()
    return {
        "jobs_per_s": (last - first) / (ended - began),
        "fetch_us": float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0)),
        "rpop_us": float(stats.get("cmdstat_rpop", {}).get("usec_per_call", 0)),
    }


def measure(reps: int = 3) -> dict[str, Any]:
    runs: dict[int, list[dict[str, float]]] = {backlog: [] for backlog in BACKLOGS}
    for rep in range(reps):
        for backlog in BACKLOGS if rep % 2 == 0 else BACKLOGS[::-1]:
            runs[backlog].append(drain(backlog))
    medians = {b: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for b, rs in runs.items()}
    small, large = (medians[b]["jobs_per_s"] for b in BACKLOGS)
    return {"server": redis_server_binary().describe(), "reps": reps, "medians": medians, "ratio": large / small}


def main(reps: int = 3) -> int:
    result = measure(reps)
    print(f"backlog drain on {result['server']}: {WORKERS} solo workers, medians of {reps} interleaved reps")
    print(f"  {'backlog':>8} {'jobs/s':>8} {'fetch us/call':>14} {'RPOP us/call':>13}")
    for backlog, row in result["medians"].items():
        print(f"  {backlog:>8,} {row['jobs_per_s']:>8,.0f} {row['fetch_us']:>14,.1f} {row['rpop_us']:>13,.1f}")
    print(f"  200,000 against 20,000: {result['ratio']:.2f}x (target >= 0.8x)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*(int(a) for a in sys.argv[1:2])))
