"""The same drain on a Redis Cluster of 1 master and of 3: jobs per second, and Redis CPU per master per job.

    python -m bench cluster [--jobs 1500] [--reps 3] [--json]     (also run by `make bench`)

Both clusters are started once (`tests.support.cluster`, no replicas, the slots split evenly between the masters)
and used rep by rep, 1 master then 3 (then 3 then 1: interleaved), each flushed before its rep. Per rep: N no-op jobs
(`bench.cluster_app`, one typed task per queue) are enqueued by a producer process with `enqueue_many`, spread
evenly over three queues whose slots sit in the three thirds of the slot space (on 3 masters: one queue each; on 1:
all three on it), no worker running; then the same worker command (`celery -A bench.cluster_app worker -Q <the
three> -P prefork -c 2`, REDIS_URL the cluster) drains them. The job records its start in a separate redis-server
(BENCH_REDIS_URL), which is also the result backend (RESULT_BACKEND_URL: the results stay off the cluster), so
the masters' figures are the broker's work only: fetch, leases, acknowledgements, wake-up markers, records.

Jobs/s: N over the time from the first job's start to the last's (the job's own records). Redis CPU: each master's
`INFO cpu` (used_cpu_user + used_cpu_sys) after the drain less before the worker started (worker boot and its idle
polls in the drain included), in µs per job; per master and summed over the masters. Ratio row: 3 masters ÷ 1.

Medians of the reps. Progress on stderr. Not a test: nothing is asserted. On a machine of few cores the workers and
the masters share them: three masters do not add throughput there; what the figures show is how the broker's work
per job spreads over the masters.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench import io_concurrency, job
from bench.procs import Workers, bench_env, redis_server, run_producer
from tests.support.cluster import Cluster

#: --jobs when not given.
JOBS = 1500
SHAPES = (1, 3)
#: The benchmark's queues (`bench.cluster_app`'s tasks), named here so that importing this module (as `python -m bench`
#: does for every part) builds no app: slots 3283, 7410 and 11409, one in each third (0-5460, 5461-10922, 10923-16383).
QUEUES = ("bench-cluster-0", "bench-cluster-1", "bench-cluster-2")
WORKER = f"celery -A bench.cluster_app worker -Q {','.join(QUEUES)} -P prefork -c 2 --loglevel WARNING"
TIMEOUT_S = 300.0


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cpu_seconds(cluster: Cluster) -> dict[int, float]:
    """Each master's CPU seconds (user + sys), by port."""
    out = {}
    for node in cluster.nodes:
        cpu = node.client().info("cpu")
        out[node.port] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return out


def flush(cluster: Cluster) -> None:
    for node in cluster.nodes:
        node.client().flushall()


def wait_done(client: redis.Redis, run: str, count: int, workers: Workers) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while int(client.get(job.keys(run)["done"]) or 0) < count:
        workers.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.get(job.keys(run)['done'])}/{count} jobs ran in {TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def drain(cluster: Cluster, results_url: str, jobs: int) -> dict[str, Any]:
    """One rep on `cluster`: enqueue, then the worker's drain; jobs/s and CPU µs per job on each master."""
    flush(cluster)
    client = redis.Redis.from_url(results_url)
    client.flushall()
    env = {**bench_env(results_url), "REDIS_URL": cluster.url(), "RESULT_BACKEND_URL": results_url}
    run = uuid.uuid4().hex[:8]
    run_producer(env, str(jobs), run, module="bench.cluster_app")
    before = cpu_seconds(cluster)
    workers = Workers([io_concurrency._argv(WORKER)], env).start()  # the virtualenv's celery
    try:
        wait_done(client, run, jobs, workers)
        after = cpu_seconds(cluster)
    finally:
        workers.stop()
    k = job.keys(run)
    first, last = (float(v) for v in client.mget(k["first"], k["last"]))
    client.close()
    per_master = [1e6 * (after[port] - before[port]) / jobs for port in sorted(before)]
    return {"jobs_per_s": jobs / (last - first), "cpu_us_per_job": per_master, "cpu_us_per_job_total": sum(per_master)}


def figures(rep: dict[str, Any]) -> dict[str, float]:
    per_master = rep["cpu_us_per_job"]
    return {
        "jobs_per_s": rep["jobs_per_s"],
        "cpu_us_per_job_busiest": max(per_master),
        "cpu_us_per_job_mean": statistics.mean(per_master),
        "cpu_us_per_job_total": rep["cpu_us_per_job_total"],
    }


def measure(jobs: int, reps: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="pipeline-bench-cluster-"))
    clusters = {n: Cluster(directory / f"masters-{n}", masters=n, replicas=0) for n in SHAPES}
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in SHAPES}
    load = os.getloadavg()[0]
    try:
        for cluster in clusters.values():
            cluster.start()
        with redis_server() as results_url:
            for rep in range(reps):
                for n in SHAPES if rep % 2 == 0 else SHAPES[::-1]:
                    runs[n].append(drain(clusters[n], results_url, jobs))
                    r = runs[n][-1]
                    cells = ", ".join(f"{us:.1f}" for us in r["cpu_us_per_job"])
                    say(f"  rep {rep + 1}/{reps}, {n} master(s): {r['jobs_per_s']:.0f} jobs/s, µs/job: {cells}")
    finally:
        for cluster in clusters.values():
            cluster.stop()
    medians = {
        n: {key: statistics.median(figures(r)[key] for r in rs) for key in figures(rs[0])} for n, rs in runs.items()
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jobs": jobs,
        "reps": reps,
        "queues": list(QUEUES),
        "worker": WORKER,
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "median": {f"{n}_masters": m for n, m in medians.items()},
        "ratio_3_to_1": {key: medians[3][key] / medians[1][key] for key in medians[1]},
        "all_reps": {f"{n}_masters": rs for n, rs in runs.items()},
    }


ROWS = (
    ("jobs_per_s", "jobs/s", "{:,.0f}"),
    ("cpu_us_per_job_busiest", "µs/job busiest master", "{:,.1f}"),
    ("cpu_us_per_job_mean", "µs/job per master", "{:,.1f}"),
    ("cpu_us_per_job_total", "µs/job all masters", "{:,.1f}"),
)


def table(result: dict[str, Any]) -> str:
    width = 22
    lines = [f"{'Redis Cluster drain':{width}}" + "".join(f"{label:>24}" for _, label, _ in ROWS)]
    for n in SHAPES:
        medians = result["median"][f"{n}_masters"]
        lines.append(f"{f'{n} master(s)':{width}}" + "".join(f"{fmt.format(medians[k]):>24}" for k, _, fmt in ROWS))
    lines.append(f"{'3 ÷ 1':{width}}" + "".join(f"{result['ratio_3_to_1'][k]:>23.2f}x" for k, _, _ in ROWS))
    lines += [
        "",
        f"{result['date']}: {result['jobs']:,} no-op jobs per rep over {len(result['queues'])} queues, "
        f"`{result['worker']}`, no replicas; medians of {result['reps']}, shapes interleaved; {result['cpus']} CPUs, "
        f"load average {result['load_average_at_start']:.1f} at start, {result['load_average_at_end']:.1f} at end. "
        "CPU: each master's INFO cpu (user + sys) over the drain (worker boot included) per job.",
    ]
    return "\n".join(lines)


def main(jobs: int = JOBS, reps: int = 3, as_json: bool = False) -> dict[str, Any]:
    result = measure(jobs, reps)
    print(json.dumps(result, indent=2) if as_json else table(result), flush=True)
    return result
