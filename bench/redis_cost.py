"""What a webhook job costs Redis itself: CPU per job on each path and bytes kept per finished job, the pipeline
against stock Celery and BullMQ.

    python -m bench redis_cost [--jobs 1000] [--reps 3] [--json]     (also run by `make bench`)

The job and the three systems are `bench.io_concurrency`'s (a signed webhook POST, here to an endpoint answering at
once): the pipeline's default I/O worker (`pipeline worker -Q webhooks`) and `tasks.webhooks.enqueue_many`, stock
Celery with its default settings (`-P threads -c 50`, `stock.webhook`, `delay()`), BullMQ (concurrency 50,
`addBulk`). Each system, each rep, gets a fresh redis-server of its own (`bench.procs.redis_server`), so nothing one
left behind (keys, scripts, fragmentation, client buffers) is counted against another.

Per run: (1) enqueue: N jobs by the system's producer process, no worker running; (2) worker: the worker started,
then every job delivered, acknowledged and its result stored (N arrivals at the endpoint, kombu's `unacked` hash
empty or BullMQ's `completed` set full, and the key count unchanged for 1 s); (3) idle: the worker left running
with nothing to do for as long as (2) took; (4) kept: the worker stopped, then Redis's memory read.

CPU: Redis's own counters, read before and after each phase (the benchmark's few INFO and DBSIZE calls are in them,
tens of microseconds in all, and out of the command tables):

* **`INFO cpu`** (`used_cpu_user` + `used_cpu_sys`, the server process): the headline. It is everything the
  server spends on a job, reading and parsing commands, writing replies and running scripts, which is what a Redis
  core's capacity is made of.
* **`INFO commandstats`** (`usec` and `calls` per command): where it goes. Execution time only (no network or
  parsing), and a command a script calls is counted in its own line and again inside the script's `evalsha`, so
  the lines do not add up to the total.

The paths: enqueue is phase (1). Fetch and lease, acknowledgement and result are phase (2) together, worker boot
included (it is over N jobs), in the headline: no Redis counter splits them, because every system runs them in the
same calls (the pipeline's fetch script stores the previous batch's results and acknowledges them before it takes
the next jobs; BullMQ's `moveToFinished` takes the next job in the call that completes one). The split beside it
comes from one more rep per system, after the measured ones, with every command of phase (2) in the SLOWLOG
(threshold 0; the log costs CPU and memory, so that rep's figures are not used otherwise). A command a script calls
is logged on its own, just before the script: each command goes to a path by its key (a result, a job record, a
completed set: acknowledgement and result), else by what it does (pops, waits, lease and delivery records written:
fetch and lease; records removed, results read and written: acknowledgement and result; events, control: other; a
transaction's EXEC by the commands it ran, each logged), and a script's own time (its Lua, arguments and reply) is
spread over its commands' paths in proportion to their time; a lease renewal script is fetch and lease. The phase's
median CPU is then divided in those proportions. Phase (3) is reported as µs per second of an idle worker, so what
polling adds to phase (2) can be judged; it is not subtracted.

Bytes kept per finished job, the headline: every key in Redis after (4), grouped by its name with ids replaced by
`<id>`, summed by `MEMORY USAGE` (the key, its value, its expiry, the allocator's rounding), divided by N; the
table names the keys. Beside it, `used_memory` less client buffers (`mem_clients_normal`) and the script cache
(`used_memory_scripts`) after (4), less the same before (1), divided by N: it runs several hundred bytes a job above
the keys for every system, memory that no key holds (it stays after a FLUSHALL: buffers and tables the server
grew while the clients worked, not freed yet), so it is shown, not taken as the figure. Each system's default
retention: results kept RESULT_EXPIRES (one day) by Celery and the pipeline, every completed job kept by BullMQ
(`removeOnComplete` unset) with its events stream. With N at most RECENT_JOBS_MAX (1,000), every job's entry in the
pipeline's recent-jobs index is counted (past it, that index stops growing).

Systems interleaved rep by rep, medians of the reps; ratios of the pipeline to each peer. Progress on stderr. Not a
test: nothing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import redis

from bench import io_concurrency as io
from bench.procs import Workers, redis_server

SYSTEMS = io.SYSTEMS
LABELS = {"pipeline": "pipeline (I/O worker)", "stock": "stock Celery threads c50", "bullmq": "BullMQ concurrency 50"}
#: Commands the benchmark itself sends: left out of the command tables.
OWN_COMMANDS = frozenset({"info", "dbsize", "scan", "memory", "hlen", "zcard", "type", "config|resetstat", "ping"})
#: A job id in a key's name: a UUID (Celery, the pipeline) or a number (BullMQ).
IDS = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|(?<=:)\d+(?=$|:)")
#: --jobs when not given: at most RECENT_JOBS_MAX, so the recent-jobs index holds every job's entry.
JOBS = 1000
#: Entries the SLOWLOG keeps in the split rep: every command of the worker phase (about 25 a job).
SLOWLOG_MAX = 1_000_000
#: The key count stays the same this long once every job arrived: results and acknowledgements have landed.
SETTLED_S = 1.0


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def snapshot(client: redis.Redis) -> dict[str, Any]:
    """Redis's CPU seconds, its command counters and its memory, now."""
    cpu = client.info("cpu")
    memory = client.info("memory")
    commands = {
        name.removeprefix("cmdstat_"): (int(stat["calls"]), int(stat["usec"]))
        for name, stat in client.info("commandstats").items()
    }
    kept = memory["used_memory"] - memory.get("mem_clients_normal", 0) - memory.get("used_memory_scripts", 0)
    return {
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "commands": commands,
        "memory": int(kept),
        "at": time.monotonic(),
    }


def delta(before: dict[str, Any], after: dict[str, Any], jobs: int) -> dict[str, Any]:
    """CPU µs per job between two snapshots, and each command's µs and calls per job."""
    commands = {}
    for name, (calls, usec) in after["commands"].items():
        calls0, usec0 = before["commands"].get(name, (0, 0))
        if calls > calls0 and name not in OWN_COMMANDS:
            commands[name] = {"usec_per_job": (usec - usec0) / jobs, "calls_per_job": (calls - calls0) / jobs}
    return {
        "cpu_us_per_job": 1e6 * (after["cpu_s"] - before["cpu_s"]) / jobs,
        "seconds": after["at"] - before["at"],
        "commands": dict(sorted(commands.items(), key=lambda kv: -kv[1]["usec_per_job"])),
    }


def key_pattern(key: bytes) -> str:
    return IDS.sub("<id>", key.decode(errors="replace"))


def kept_keys(client: redis.Redis, jobs: int) -> dict[str, dict[str, float]]:
    """Every key grouped by its pattern: how many, and their `MEMORY USAGE` per job, largest first."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key in client.scan_iter(count=1000):
        group = groups[key_pattern(key)]
        group[0] += 1
        group[1] += int(client.memory_usage(key, samples=0) or 0)
    return {
        pattern: {"keys": count, "bytes_per_job": size / jobs}
        for pattern, (count, size) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    }


#: The paths of the split (every run ends with one rep per system for it: see the module doc).
FETCH, FINISH, OTHER = "fetch and lease", "acknowledge and result", "other"
#: Commands of the fetch and lease path, whatever their key: taking a job, waiting for one, keeping its lease.
FETCH_COMMANDS = frozenset(
    "rpop lpop brpop blpop blmove blmpop lmove rpoplpush brpoplpush llen time exists hincrby rpush ltrim expire "  # noqa: SIM905
    "pexpire zadd hset hmset set sadd lpush zrangebyscore zrange hexists smembers".split()
)
#: Commands of the acknowledgement and result path: removing a held job's records, storing its result.
FINISH_COMMANDS = frozenset("zrem hdel del lrem srem get setex psetex".split())  # noqa: SIM905
#: A BullMQ job hash written when the job finishes (`moveToFinished`), not when it is taken.
FINISHED_FIELDS = re.compile(rb"\b(returnvalue|finishedOn|failedReason)\b")
#: Scripts whose every call keeps leases (the pipeline's): their commands are the fetch and lease path's.
LEASE_SCRIPTS = frozenset({"renew", "release"})


def path_of(command: bytes, script: str | None) -> str:
    """The path one logged command belongs to: by its key first (a result, a job record, a completed set), then by
    what it does; inside a lease-keeping script, the lease's path; events and control are `other`."""
    words = command.split(b" ")
    name, key = words[0].decode().lower(), (words[1] if len(words) > 1 else b"")
    if script in LEASE_SCRIPTS:
        return FETCH
    if key.startswith((b"celery-task-meta-", b"pipeline:job:")) or key.endswith((b":completed", b":failed")):
        return FINISH
    if name == "hget" and key == b"pipeline:lease":
        return FINISH  # the fetch script's fences: of a result to store and of an acknowledgement
    if name in ("hset", "hmset") and FINISHED_FIELDS.search(command):
        return FINISH
    if name in FINISH_COMMANDS:
        return FINISH
    if name in FETCH_COMMANDS:
        return FETCH
    return OTHER


def split(entries: list[dict[str, Any]], scripts: dict[str, str], jobs: int) -> dict[str, float]:
    """SLOWLOG entries (every command, threshold 0) divided among the paths, µs of execution per job. A script's
    commands are logged before it (client `?:0`), each counted on its own path; the rest of the script's time (its
    Lua, its arguments and reply) is spread over its commands' paths in proportion to their time."""
    paths: dict[str, float] = defaultdict(float)
    inner: list[dict[str, Any]] = []
    for entry in sorted(entries, key=lambda e: e["id"]):
        if entry["client_address"] == b"?:0":
            inner.append(entry)
            continue
        words = entry["command"].split(b" ")
        name = words[0].decode().lower()
        if name in OWN_COMMANDS or name == "exec" or name.startswith(("slowlog", "config")):  # EXEC: by its commands
            inner = []
            continue
        if name in ("evalsha", "eval"):
            script = scripts.get(words[1].decode(errors="replace")) if name == "evalsha" else None
            own: dict[str, float] = defaultdict(float)
            for sub in inner:
                own[path_of(sub["command"], script)] += sub["duration"]
            rest = entry["duration"] - sum(own.values())
            total = sum(own.values())
            for path, usec in own.items():
                paths[path] += usec + rest * (usec / total if total else 1 / len(own))
            if not own:
                paths[FETCH if script in LEASE_SCRIPTS else OTHER] += entry["duration"]
        else:
            paths[path_of(entry["command"], None)] += entry["duration"]
        inner = []
    return {path: paths.get(path, 0.0) / jobs for path in (FETCH, FINISH, OTHER)}


def script_names() -> dict[str, str]:
    """The pipeline's scripts by their SHA1 (what EVALSHA names)."""
    from pipeline.lua import names, sha

    return {sha(name): name for name in names()}


def settled(client: redis.Redis, system: str, jobs: int) -> bool:
    """Every delivered job acknowledged (kombu's `unacked` hash empty; BullMQ: N completed)."""
    if system == "bullmq":
        return int(client.zcard("bull:bench-io:completed")) >= jobs
    return int(client.hlen("unacked")) == 0


def wait_done(bench: io.Bench, client: redis.Redis, workers: Workers, system: str) -> None:
    """Until N jobs arrived, none is in flight, every one is acknowledged and the key count is still for SETTLED_S."""
    n, began = bench.options.jobs, time.monotonic()
    count, since = -1, time.monotonic()
    while True:
        stats = bench.endpoint.stats()
        now = time.monotonic()
        if stats["arrivals"] >= n and stats["in_flight"] == 0 and settled(client, system, n):
            size = int(client.dbsize())
            if size != count:
                count, since = size, now
            elif now - since >= SETTLED_S:
                return
        workers.check()
        if now - began > bench.options.timeout:
            raise TimeoutError(f"{system}: {stats['arrivals']}/{n} arrived after {bench.options.timeout:.0f} s")
        time.sleep(0.2)


def run(system: str, jobs: int, endpoint: io.Endpoint, logged: bool = False) -> dict[str, Any]:
    """One system's phases on a Redis of its own; `logged`: every command of the worker phase in the SLOWLOG, for
    the split (a rep of its own: the log costs CPU and memory)."""
    with redis_server() as url:
        bench = io.Bench(url, io.Options(jobs=jobs, latency=0.0, reps=1, timeout=600.0), endpoint)
        client = redis.Redis.from_url(url)
        endpoint.reset()
        endpoint.open()
        argvs = [io._argv(c) for c in bench.commands(system)]
        env = {"pipeline": bench.pipeline_env, "stock": bench.env, "bullmq": bench.node_env}[system]
        start = snapshot(client)
        bench.produce(system)
        enqueued = snapshot(client)
        if logged:
            client.config_set("slowlog-max-len", SLOWLOG_MAX)
            client.slowlog_reset()
            client.config_set("slowlog-log-slower-than", 0)
        workers = Workers(argvs, env).start()
        sampler = io.RssSampler([p.pid for p in workers.procs])  # every PID of the trees, for the clean-up
        sampler.start()
        try:
            wait_done(bench, client, workers, system)
            drained = snapshot(client)
            if logged:
                client.config_set("slowlog-log-slower-than", -1)
                paths = split(client.slowlog_get(SLOWLOG_MAX), script_names(), jobs)
            time.sleep(0 if logged else max(1.0, drained["at"] - enqueued["at"]))  # the split rep has no idle phase
            idle = snapshot(client)
        finally:
            sampler.stop()
            io.stop(workers, sampler.seen)
        time.sleep(0.5)
        kept = snapshot(client)
        keys = kept_keys(client, jobs)
        client.close()
        shutil.rmtree(bench.data, ignore_errors=True)
    idle_delta = delta(drained, idle, 1)
    if logged:
        return {"enqueue_us": delta(start, enqueued, jobs)["cpu_us_per_job"], "paths": paths}
    return {
        "enqueue": delta(start, enqueued, jobs),
        "worker": delta(enqueued, drained, jobs),
        "idle_cpu_us_per_s": idle_delta["cpu_us_per_job"] / idle_delta["seconds"],
        "used_memory_per_job": (kept["memory"] - start["memory"]) / jobs,
        "keys": keys,
    }


def figures(r: dict[str, Any]) -> dict[str, float]:
    enqueue, worker = r["enqueue"]["cpu_us_per_job"], r["worker"]["cpu_us_per_job"]
    return {
        "enqueue_us": enqueue,
        "worker_us": worker,
        "total_us": enqueue + worker,
        "idle_us_per_s": r["idle_cpu_us_per_s"],
        "bytes_kept": sum(k["bytes_per_job"] for k in r["keys"].values()),
        "used_memory_per_job": r["used_memory_per_job"],
    }


def measure(jobs: int, reps: int) -> dict[str, Any]:
    endpoint = io.Endpoint(0.0)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    splits: dict[str, dict[str, Any]] = {}
    load = os.getloadavg()[0]
    try:
        for rep in range(reps):
            for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                runs[system].append(run(system, jobs, endpoint))
                f = figures(runs[system][-1])
                say(
                    f"  rep {rep + 1}/{reps} {system}: {f['total_us']:.1f} µs of Redis CPU per job "
                    f"(enqueue {f['enqueue_us']:.1f}, worker {f['worker_us']:.1f}), {f['bytes_kept']:.0f} bytes kept"
                )
        for system in SYSTEMS:
            splits[system] = run(system, jobs, endpoint, logged=True)
            say(f"  split {system}: " + ", ".join(f"{p} {u:.1f}" for p, u in splits[system]["paths"].items()))
    finally:
        endpoint.stop()
    medians = {s: {k: statistics.median(figures(r)[k] for r in rs) for k in figures(rs[0])} for s, rs in runs.items()}
    ours = medians["pipeline"]
    ratios = {
        peer: {k: ours[k] / medians[peer][k] if medians[peer][k] else math.nan for k in ours} for peer in SYSTEMS[1:]
    }
    for system, one in splits.items():  # the worker phase's median CPU, in the logged rep's proportions
        logged = sum(one["paths"].values())
        one["cpu_us"] = {
            p: medians[system]["worker_us"] * u / logged if logged else 0.0 for p, u in one["paths"].items()
        }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jobs": jobs,
        "reps": reps,
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "median": medians,
        "ratios": ratios,
        # the last rep's detail: commands per phase and the keys kept
        "detail": {s: rs[-1] for s, rs in runs.items()},
        "all_reps": {s: [figures(r) for r in rs] for s, rs in runs.items()},
        "split": splits,
    }


ROWS = (
    ("enqueue_us", "enqueue µs", "{:,.1f}"),
    ("worker_us", "fetch+ack+result µs", "{:,.1f}"),
    ("total_us", "total µs/job", "{:,.1f}"),
    ("idle_us_per_s", "idle µs/s", "{:,.0f}"),
    ("bytes_kept", "bytes kept/job", "{:,.0f}"),
    ("used_memory_per_job", "used_memory Δ/job", "{:,.0f}"),
)


def table(result: dict[str, Any]) -> str:
    medians, ratios = result["median"], result["ratios"]
    width = 26
    lines = [f"{'Redis, per webhook job':{width}}" + "".join(f"{label:>21}" for _, label, _ in ROWS)]
    for system in SYSTEMS:
        lines.append(
            f"{LABELS[system]:{width}}" + "".join(f"{fmt.format(medians[system][k]):>21}" for k, _, fmt in ROWS)
        )
    for peer in SYSTEMS[1:]:
        name = "pipeline ÷ " + ("BullMQ" if peer == "bullmq" else "stock Celery")
        lines.append(f"{name:{width}}" + "".join(f"{ratios[peer][k]:>20.2f}x" for k, _, _ in ROWS))
    lines += [
        "",
        f"{result['date']}: {result['jobs']:,} webhook jobs per system and rep, each system on a fresh redis-server; "
        f"medians of {result['reps']}, systems interleaved; {result['cpus']} CPUs, load average "
        f"{result['load_average_at_start']:.1f} at start, {result['load_average_at_end']:.1f} at end. CPU: INFO cpu "
        "(user + sys) per phase; bytes kept: MEMORY USAGE of every key after the worker stopped; used_memory Δ: "
        "used_memory (less client buffers and scripts) after, less before the enqueue (memory no key holds "
        "included). Goal: total at most half of BullMQ's "
        "(ratio <= 0.50), bytes kept <= 500.",
    ]
    paths = (FETCH, FINISH, OTHER)
    lines.append(f"\n{'Redis CPU µs/job by path':{width}}{'enqueue':>21}" + "".join(f"{p:>24}" for p in paths))
    for system in SYSTEMS:
        one = result["split"][system]
        lines.append(
            f"{LABELS[system]:{width}}{medians[system]['enqueue_us']:>21,.1f}"
            + "".join(f"{one['cpu_us'][p]:>24,.1f}" for p in paths)
        )
    for peer in SYSTEMS[1:]:
        name = "pipeline ÷ " + ("BullMQ" if peer == "bullmq" else "stock Celery")
        ours, theirs = result["split"]["pipeline"]["cpu_us"], result["split"][peer]["cpu_us"]
        cells = [ratios[peer]["enqueue_us"], *(ours[p] / theirs[p] if theirs[p] else math.nan for p in paths)]
        lines.append(f"{name:{width}}{cells[0]:>20.2f}x" + "".join(f"{c:>23.2f}x" for c in cells[1:]))
    lines.append(
        "  the worker phase's median (INFO cpu) divided in the proportions of a rep of its own per system with every "
        "command of the phase in the SLOWLOG (execution µs: "
        + "; ".join(f"{s} " + ", ".join(f"{result['split'][s]['paths'][p]:.1f}" for p in paths) for s in SYSTEMS)
        + ")"
    )
    for system in SYSTEMS:
        detail = result["detail"][system]
        lines.append(f"\n{LABELS[system]}, last rep: µs (calls) per job by command")
        for phase in ("enqueue", "worker"):
            top = list(detail[phase]["commands"].items())[:8]
            cells = ", ".join(f"{n} {c['usec_per_job']:.1f} ({c['calls_per_job']:.2f})" for n, c in top)
            lines.append(f"  {phase:8} {cells}")
        keys = ", ".join(f"{p} {k['bytes_per_job']:.0f}" for p, k in list(detail["keys"].items())[:6])
        lines.append(f"  kept     {keys}")
    return "\n".join(lines)


def main(jobs: int = JOBS, reps: int = 3, as_json: bool = False) -> dict[str, Any]:
    result = measure(jobs, reps)
    print(json.dumps(result, indent=2) if as_json else table(result), flush=True)
    return result
