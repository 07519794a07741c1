"""Stock Celery (default settings) against the pipeline, in one run on one throwaway Redis, by the method of
`../shared/reference/performance.md`: every figure comes from what the jobs recorded in Redis (`bench.job`).

* enqueue single: N sequential one-job calls, no worker (stock `delay()`, pipeline `enqueue()`);
* enqueue bulk: one multi-job call (stock `group()`, pipeline `enqueue_many()`), ratio to stock single;
* drain: N jobs queued, then the worker command line started; rate = N / (last job started - first job
  started), so worker boot is excluded and nothing polls a clock;
* start latency: a warm idle worker, jobs sent at a fixed rate (200/s) for some seconds; p50/p99 of
  (job start - enqueue time);
* start latency, worker on every queue (`every`): the same, the worker consuming the queues a `pipeline worker`
  consumes (default, email, pdf, transcode, webhooks) besides the benchmark's own, listed last (stock Celery's
  worker on the same queues).

Each producer runs in a process of its own (`bench.producer`); workers are the stock CLI command lines
(`-P prefork -c 2 --loglevel WARNING`), replaceable per system (`--pipeline-worker`, repeatable to run several
processes). Reps are interleaved (system order alternates), medians printed.
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from bench import job
from bench.procs import Workers, bench_env, run_producer

SYSTEMS = ("stock", "pipeline")
PARTS = ("enqueue", "bulk", "drain", "latency", "every")
DEFAULT_WORKERS = {
    "stock": ["celery -A bench.stock_app worker -P prefork -c 2 --loglevel WARNING"],
    "pipeline": ["celery -A bench.pipeline_app worker -Q bench-pipeline -P prefork -c 2 --loglevel WARNING"],
}
#: The queues a `pipeline worker` consumes (`pipeline.constants.WORK_QUEUES`), then each system's own: the `every` part.
_EVERY = "-Q default,email,pdf,transcode,webhooks,{} -P prefork -c 2 --loglevel WARNING"
EVERY_QUEUE_WORKERS = {
    "stock": ["celery -A bench.stock_app worker " + _EVERY.format("celery")],
    "pipeline": ["celery -A bench.pipeline_app worker " + _EVERY.format("bench-pipeline")],
}
#: Ratios to stock Celery from `../shared/reference/performance.md` (measured there, not here).
REFERENCE = {
    "enqueue": ("3.4-3.7", "4.7-5.0"),
    "bulk": ("3.4-4.0 (group)", "12-15 (addBulk)"),
    "drain": ("3.0-6.6", "10.7-12.6"),
    "p50": ("—", "—"),
    "p99": ("5-130x worse", "≈1"),
    "p50_every": ("—", "—"),
    "p99_every": ("—", "—"),
}


@dataclass
class Options:
    reps: int = 3
    single: int = 5000
    bulk: int = 5000
    drain: int = 5000
    rate: float = 200.0
    seconds: float = 10.0
    parts: tuple[str, ...] = PARTS
    workers: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_WORKERS))


class Bench:
    def __init__(self, url: str, options: Options) -> None:
        self.url = url
        self.options = options
        self.client = redis.Redis.from_url(url)
        #: Every process gets the throwaway Redis; only the pipeline's read REDIS_URL (and its settings).
        self.env = bench_env(url)

    def producer(self, system: str, *args: object) -> dict[str, Any]:
        return run_producer(self.env, system, *args)

    def workers(self, system: str, lines: dict[str, list[str]] | None = None) -> Workers:
        commands = [shlex.split(c) for c in (lines or self.options.workers)[system]]
        for argv in commands:
            if argv and argv[0] == "celery":  # the venv's, whatever PATH says
                argv[0] = os.path.join(os.path.dirname(sys.executable), "celery")
        return Workers(commands, self.env).start()

    def wait_done(self, run: str, count: int, workers: Workers, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        key = job.keys(run)["done"]
        while int(self.client.get(key) or 0) < count:
            workers.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run}: {self.client.get(key)!r} of {count} jobs done")
            time.sleep(0.1)

    def enqueue(self, system: str) -> dict[str, float]:
        self.client.flushdb()
        out = self.producer(system, "single", self.options.single, _run())
        return {"enqueue": out["jobs"] / out["seconds"]}

    def bulk(self, system: str) -> dict[str, float]:
        self.client.flushdb()
        out = self.producer(system, "bulk", self.options.bulk, _run())
        return {"bulk": out["jobs"] / out["seconds"]}

    def drain(self, system: str) -> dict[str, float]:
        self.client.flushdb()
        run, count = _run(), self.options.drain
        self.producer(system, "bulk", count, run)
        workers = self.workers(system)
        try:
            self.wait_done(run, count, workers)
        finally:
            workers.stop()
        k = job.keys(run)
        first, last = (float(v) for v in self.client.mget(k["first"], k["last"]))
        return {"drain": count / (last - first)}

    def latency(self, system: str, lines: dict[str, list[str]] | None = None) -> dict[str, float]:
        self.client.flushdb()
        workers = self.workers(system, lines)
        try:
            warm = _run()
            self.producer(system, "single", 50, warm)  # boots the worker's pool and connections
            self.wait_done(warm, 50, workers)
            run = _run()
            sent = self.producer(system, "paced", self.options.rate, self.options.seconds, run)
            self.wait_done(run, sent["jobs"], workers)
        finally:
            workers.stop()
        values = sorted(float(v) * 1000 for v in self.client.lrange(job.keys(run)["lat"], 0, -1))
        return {"p50": _quantile(values, 0.5), "p99": _quantile(values, 0.99), "late_sends": sent["late_sends"]}

    def every(self, system: str) -> dict[str, float]:
        """Start latency of a worker on every queue (`EVERY_QUEUE_WORKERS`)."""
        return {f"{name}_every": value for name, value in self.latency(system, EVERY_QUEUE_WORKERS).items()}


def _run() -> str:
    return uuid.uuid4().hex[:12]


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(url: str, options: Options, say: Callable[[str], None]) -> dict[str, Any]:
    """Run every selected part, reps interleaved; return per-system medians and the raw reps."""
    bench = Bench(url, options)
    reps: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
    for rep in range(options.reps):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for part in options.parts:
            for system in order:
                say(f"  rep {rep + 1}/{options.reps} {part:8} {system}")
                for name, value in getattr(bench, part)(system).items():
                    reps[system].setdefault(name, []).append(value)
    medians = {s: {name: statistics.median(v) for name, v in figures.items()} for s, figures in reps.items()}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "reps": options.reps,
        "jobs": {"single": options.single, "bulk": options.bulk, "drain": options.drain},
        "latency": {"rate": options.rate, "seconds": options.seconds},
        "workers": options.workers,
        "median": medians,
        "ratios": ratios(medians),
        "all_reps": reps,
    }


def ratios(medians: dict[str, dict[str, float]]) -> dict[str, float]:
    """Throughput ratios to stock Celery (bulk against stock single, as in the reference); latency ratios as
    pipeline ÷ stock (lower is better)."""
    stock, ours = medians["stock"], medians["pipeline"]
    out = {}
    for name in ("enqueue", "drain", "p50", "p99", "p50_every", "p99_every"):
        if name in stock and name in ours:
            out[name] = ours[name] / stock[name]
    if "bulk" in ours and "enqueue" in stock:
        out["bulk"] = ours["bulk"] / stock["enqueue"]
    if "bulk" in stock and "enqueue" in stock:
        out["stock_bulk"] = stock["bulk"] / stock["enqueue"]
    return out


ROWS = (
    ("enqueue", "enqueue single (jobs/s)", "{:,.0f}"),
    ("bulk", "enqueue bulk (jobs/s)", "{:,.0f}"),
    ("drain", "drain (jobs/s)", "{:,.0f}"),
    ("p50", "start latency p50 (ms)", "{:.1f}"),
    ("p99", "start latency p99 (ms)", "{:.1f}"),
    ("p50_every", "  every queue: p50 (ms)", "{:.1f}"),
    ("p99_every", "  every queue: p99 (ms)", "{:.1f}"),
)


def table(result: dict[str, Any]) -> str:
    medians, r = result["median"], result["ratios"]
    head = f"{'':26}{'stock Celery':>14}{'pipeline':>12}{'ratio':>9}   {'Dramatiq (ref.)':<17}{'BullMQ (ref.)'}"
    lines = [head]
    for name, label, fmt in ROWS:
        if name not in medians["pipeline"]:
            continue
        stock = fmt.format(medians["stock"][name]) if name in medians["stock"] else "—"
        ratio = f"{r[name]:.2f}x" if name in r else "—"
        dramatiq, bullmq = REFERENCE[name]
        lines.append(
            f"{label:26}{stock:>14}{fmt.format(medians['pipeline'][name]):>12}{ratio:>9}   {dramatiq:<17}{bullmq}"
        )
    lines.append("")
    lines.append(
        f"{result['date']}; medians of {result['reps']}, systems interleaved; ratios are pipeline ÷ stock (bulk: ÷ "
        "stock single, as in the reference; latency: lower is better). Dramatiq/BullMQ columns are fixed "
        "reference ratios from ../shared/reference/performance.md, not measured here."
    )
    lines.append("issue #12 targets: enqueue >= 1.2x, bulk >= 12x (stock single), drain >= 1.5x, p99 <= 1x (stock's)")
    lines.append("issue #24 target: every queue p99 <= 2x (stock's)")
    if "stock_bulk" in r:
        lines.append(f"stock group() ÷ stock single: {r['stock_bulk']:.2f}x")
    for system, commands in result["workers"].items():
        lines.append(f"{system} worker: {' + '.join(commands)}")
    if "p99_every" in medians["pipeline"]:
        for system, commands in EVERY_QUEUE_WORKERS.items():
            lines.append(f"{system} worker on every queue: {' + '.join(commands)}")
    return "\n".join(lines)
