"""What REDIS_WAIT_REPLICAS=1 costs per enqueue: a primary and one replica on loopback, N = 0 against N = 1.

Both settings are measured in the same run, reps interleaved (the order alternates), each in a producer process of
its own (`bench.producer`) on the primary; medians printed, with the ratio of N = 1 to N = 0. Two shapes:
`enqueue()` one job per call, and `enqueue_many()` of 100 jobs per call. No worker runs; the database is flushed
before each measurement (the replica follows).

    python -m bench replicated_enqueue            (or `python -m bench.replicated_enqueue [REPS]`)
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from bench.procs import bench_env, free_port, run_producer
from pipeline.cli.redis_bin import redis_binary

SINGLE = 3000
BATCHES, BATCH = 60, 100


@contextlib.contextmanager
def _server(directory: Path, *extra: str) -> Iterator[redis.Redis]:
    port = free_port()
    argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", ""]
    proc = subprocess.Popen([*argv, "--appendonly", "no", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        yield client
    finally:
        proc.terminate()
        proc.wait(10)


def _synced(primary: redis.Redis) -> None:
    for _ in range(200):
        if int(primary.execute_command("WAIT", 1, 100)) == 1 and primary.info("replication")["connected_slaves"]:
            return
        time.sleep(0.05)
    raise RuntimeError("the replica did not sync")


def measure(reps: int = 5) -> dict[str, Any]:
    """Per shape and N: the median seconds per job and jobs per second, and N=1's cost against N=0's."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-replicated-") as directory,
        _server(Path(directory), "--dbfilename", "primary.rdb") as primary,
    ):
        port = primary.connection_pool.connection_kwargs["port"]
        replica_args = ("--dbfilename", "replica.rdb", "--replicaof", "127.0.0.1", str(port))
        with _server(Path(directory), *replica_args):
            _synced(primary)
            env = bench_env(f"redis://127.0.0.1:{port}/0")
            shapes = {"enqueue": ("single", SINGLE), "enqueue_many(100)": ("batches", BATCHES, BATCH)}
            seconds: dict[tuple[str, int], list[float]] = {}
            for rep in range(reps):
                for wait in (0, 1) if rep % 2 == 0 else (1, 0):
                    for shape, args in shapes.items():
                        primary.flushall()
                        _synced(primary)
                        waited = {**env, "REDIS_WAIT_REPLICAS": str(wait)}
                        out = run_producer(waited, "pipeline", *args, f"replicated-{rep}-{wait}")
                        seconds.setdefault((shape, wait), []).append(out["seconds"] / out["jobs"])
    result: dict[str, Any] = {"reps": reps}
    for shape in shapes:
        per_job = {wait: statistics.median(seconds[(shape, wait)]) for wait in (0, 1)}
        result[shape] = {
            "us_per_job": {f"N={w}": round(v * 1e6, 1) for w, v in per_job.items()},
            "jobs_per_s": {f"N={w}": round(1 / v) for w, v in per_job.items()},
            "cost_ratio": round(per_job[1] / per_job[0], 2),
            "added_us_per_job": round((per_job[1] - per_job[0]) * 1e6, 1),
        }
    return result


def main(reps: int = 5) -> int:
    result = measure(reps)
    print(f"REDIS_WAIT_REPLICAS: primary + 1 replica on loopback, medians of {reps} interleaved reps")
    print(f"  {'':20} {'N=0 jobs/s':>12} {'N=1 jobs/s':>12} {'N=1 / N=0 time':>15} {'added per job':>14}")
    for shape in ("enqueue", "enqueue_many(100)"):
        row = result[shape]
        rate0, rate1 = row["jobs_per_s"]["N=0"], row["jobs_per_s"]["N=1"]
        print(f"  {shape:20} {rate0:>12} {rate1:>12} {row['cost_ratio']:>14}x {row['added_us_per_job']:>11} us")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*(int(a) for a in sys.argv[1:2])))
