"""Worker profiles against stock Celery: drain rate and start latency of one queue, per worker command line.

    .venv/bin/python -m bench.worker_profiles [--jobs 5000] [--reps 3] [--only NAME,...] [--baseline CHECKOUT]

Method (../shared/reference/performance.md): a throwaway redis-server (no persistence); the job is a no-op
that makes one pipelined Redis round trip at start (SETNX first-start, INCR done, SET last-done, RPUSH
its start latency when the payload carries an enqueue time).
* Drain: the worker process(es) start and answer a ping (boot excluded, and no process drains alone while
  others boot); N jobs are pushed in one round trip; rate = N / (last job started - first job started),
  both read from what the jobs wrote: no polling loop on the clock.
* Start latency: the same worker, warm and idle, gets jobs at a fixed rate (200/s for 10 s), each pushed with its
  wake-up marker as a publish of the pipeline pushes it (`pipeline.queues.wake`); latency = job
  start - enqueue time; p50 and p99.
Queues are filled by cloning one message the system's own `apply_async` published (new task id and
delivery tag, the payload re-encoded), so the producer's speed is out of the figures. Systems are
interleaved rep by rep; medians of the reps; ratios against stock Celery (default settings, prefork c=2,
in its own process). Worker log level WARNING everywhere. The pipeline's workers run with everything on
(DLQ capture, metrics in multiprocess mode with an endpoint, job records on the producer side, stall
watchdog, delayed-job releaser). `--baseline /path/to/another/checkout` also runs each chosen pipeline system
from that checkout (its code and `.venv`), interleaved with the rest: before and after in one run.

`celery -A bench.worker_profiles:stock` is stock Celery (broker and result backend on the same Redis,
nothing else set); `celery -A bench.worker_profiles:app` is the pipeline's app (what `celery -A pipeline`
runs) plus the no-op typed task.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from bench.procs import ROOT, free_port, redis_server
from pipeline.broker import queue_keys
from pipeline.queues import wake

KEY = "bench:wp"
LATENCY_RATE = 200.0
LATENCY_SECONDS = 10.0


def _record(client: redis.Redis, payload: dict[str, Any]) -> None:
    """The job: one pipelined round trip."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.setnx(f"{KEY}:first", now)
    pipe.incr(f"{KEY}:done")
    pipe.set(f"{KEY}:last", now)
    if payload.get("sent_at"):
        pipe.rpush(f"{KEY}:lat", now - float(payload["sent_at"]))
    pipe.execute()


_clients: dict[int, redis.Redis] = {}


def _client() -> redis.Redis:
    pid = os.getpid()  # one client per process (prefork children fork after import)
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(os.environ["REDIS_URL"])
    return _clients[pid]


def _stock() -> Any:
    from celery import Celery

    url = os.environ["REDIS_URL"]
    stock = Celery("stock", broker=url, backend=url)

    @stock.task(name="stock.noop")
    def noop(payload: dict[str, Any]) -> None:
        _record(_client(), payload)

    return stock


def _pipeline() -> Any:
    from pydantic import BaseModel

    from pipeline import app as pipeline_app
    from pipeline.task import JobContext, typed_task

    class NoopJob(BaseModel):
        sent_at: float | None = None

    class NoopResult(BaseModel):
        ok: bool = True

    track = os.environ.get("BENCH_TRACK_STARTED") == "true"

    @typed_task(
        "bench.noop",
        kind="bench-noop",
        payload=NoopJob,
        result=NoopResult,
        public=False,
        track_started=track,
    )
    def noop(job: NoopJob, ctx: JobContext) -> NoopResult:
        _record(_client(), job.model_dump())
        return NoopResult()

    return pipeline_app


_apps: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """`stock` and `app`, built on first use (celery -A bench.worker_profiles:stock|app)."""
    if name not in ("stock", "app"):
        raise AttributeError(name)
    if name not in _apps:
        _apps[name] = _stock() if name == "stock" else _pipeline()
    return _apps[name]


@dataclass
class System:
    name: str
    app: str  # "stock" or "app"
    queue: str
    #: One worker command line per process (after `celery -A ... worker`).
    procs: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    #: N: `pipeline worker --processes N` (workers under the supervisor) instead of `procs`.
    supervised: int = 0
    #: The supervised workers' pool (`pipeline worker --pool`).
    pool: str = "solo"
    #: Another checkout to run the workers from (its code and its `.venv`); None: this one.
    root: Path | None = None


def systems(queue: str) -> list[System]:
    c2 = ["-P", "prefork", "-c", "2"]
    return [
        System("stock celery prefork c2", "stock", "celery", [c2]),
        # Celery's own per-job floor: two stock solo workers, no events, nothing of the pipeline's
        System("stock celery 2 x solo", "stock", "celery", [["-P", "solo"], ["-P", "solo"]]),
        System("pipeline on main (events, track_started, prefetch 1)", "app", queue, [c2], _on_main()),
        System("pipeline prefork c2 (lean default)", "app", queue, [c2]),
        System("pipeline prefork c2 + events (Flower)", "app", queue, [c2], {"TASK_EVENTS": "true"}),
        System("pipeline threads c8", "app", queue, [["-P", "threads", "-c", "8"]]),
        System("pipeline threads c16", "app", queue, [["-P", "threads", "-c", "16"]]),
        System("pipeline worker --processes 2 (asyncio)", "app", queue, [], supervised=2, pool="asyncio"),
        System("pipeline worker --processes 3 (asyncio)", "app", queue, [], supervised=3, pool="asyncio"),
        *(_solo(queue, n, prefetch) for n, prefetch in ((2, None), (2, 8), (3, None), (3, 8), (4, None))),
        System("pipeline gevent c16", "app", queue, [["-P", "gevent", "-c", "16"]]),
    ]


def _solo(queue: str, n: int, prefetch: int | None) -> System:
    """`pipeline worker --processes n --pool solo`, with a prefetch multiplier other than the profile's if given."""
    if prefetch is None:
        return System(f"pipeline worker --processes {n} (solo)", "app", queue, [], supervised=n)
    env = {"WORKER_PREFETCH_MULTIPLIER": str(prefetch)}
    return System(f"pipeline worker --processes {n} (solo, prefetch {prefetch})", "app", queue, [], env, supervised=n)


def _on_main() -> dict[str, str]:
    """Main's worker defaults, restored with settings: task events on, STARTED stored, prefetch 1."""
    return {"TASK_EVENTS": "true", "BENCH_TRACK_STARTED": "true", "WORKER_PREFETCH_MULTIPLIER": "1"}


class Workers:
    def __init__(self, system: System, url: str) -> None:
        self.system = system
        self.url = url
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self) -> None:
        system = self.system
        python = str(system.root / ".venv" / "bin" / "python") if system.root else sys.executable
        supervisor = [python, "-m", "pipeline", "worker", "--pool", system.pool, "--processes", str(system.supervised)]
        supervisor += ["--app", f"bench.worker_profiles:{system.app}", "-Q", system.queue, "-l", "WARNING"]
        for index, extra in enumerate([supervisor] if system.supervised else system.procs):
            log = Path(tempfile.mkstemp(prefix="bench-wp-", suffix=".log")[1])
            metrics = tempfile.mkdtemp(prefix="bench-wp-metrics-")
            env = {
                **os.environ,
                "REDIS_URL": self.url,
                "LOG_LEVEL": "WARNING",
                "METRICS_PORT": str(free_port()),
                "DATA_DIR": metrics,
                "METRICS_ADDRESS": "127.0.0.1",
                "PROMETHEUS_MULTIPROC_DIR": metrics,
                "WORKER_HEALTH_DIR": metrics,
                **self.system.env,
            }
            argv = [python, "-m", "celery", "-A", f"bench.worker_profiles:{system.app}", "worker"]
            argv += [*extra, "-Q", system.queue, "-n", f"bench{index}@%h", "-l", "WARNING"]
            argv = extra if system.supervised else argv
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, cwd=system.root or ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            self.procs.append(proc)
            self.logs.append(log)
        control = __getattr__("stock").control  # any app on this Redis: the control exchange is the same
        deadline = time.monotonic() + 60
        while len(control.ping(timeout=0.5)) < (system.supervised or len(self.procs)):
            for proc, log in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log.read_text())

    def stop(self) -> None:
        if self.system.supervised:  # its workers run in sessions of their own: it stops them
            for proc in self.procs:
                proc.terminate()
                proc.wait(60)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)
        for log in self.logs:
            log.unlink(missing_ok=True)


def template(system: System) -> dict[str, Any]:
    """One message as the system's own producer publishes it (popped back off its queue)."""
    app = __getattr__(system.app)
    client = _client()
    task = app.tasks["stock.noop" if system.app == "stock" else "bench.noop"]
    task.apply_async(({"sent_at": None},), queue=system.queue)
    # The pipeline's producer publishes to the queue's list for the job's priority (`pipeline.broker.queue_keys`).
    raw = next(filter(None, (client.rpop(key) for key in queue_keys(system.queue))), None)
    assert raw is not None, f"nothing published to {system.queue}"
    message: dict[str, Any] = json.loads(raw)
    return message


def clone(message: dict[str, Any], sent_at: float | None) -> bytes:
    task_id = str(uuid.uuid4())
    _args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
    headers = {**message["headers"], "id": task_id, "root_id": task_id}
    if "pipeline_published_at" in headers:
        headers["pipeline_published_at"] = sent_at or time.time()
    properties = {**message["properties"], "correlation_id": task_id, "delivery_tag": str(uuid.uuid4())}
    body = base64.b64encode(json.dumps([[{"sent_at": sent_at}], kwargs, embed]).encode()).decode()
    return json.dumps({**message, "headers": headers, "properties": properties, "body": body}).encode()


def _reset(client: redis.Redis) -> None:
    client.delete(f"{KEY}:first", f"{KEY}:done", f"{KEY}:last", f"{KEY}:lat")


def _wait_done(client: redis.Redis, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while int(client.get(f"{KEY}:done") or 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{client.get(f'{KEY}:done')} of {n} jobs done")
        time.sleep(0.2)


def run_once(system: System, url: str, jobs: int) -> dict[str, float]:
    client = _client()
    message = template(system)
    clones = [clone(message, None) for _ in range(jobs)]
    workers = Workers(system, url)
    try:
        workers.start()  # every process ready and idle: none drains alone while the others boot
        _reset(client)
        pipe = client.pipeline(transaction=False)
        for start in range(0, jobs, 1000):
            pipe.lpush(system.queue, *clones[start : start + 1000])
        pipe.execute()
        _wait_done(client, jobs)
        first, last = float(client.get(f"{KEY}:first") or 0), float(client.get(f"{KEY}:last") or 0)
        drain = jobs / (last - first)
        time.sleep(1.0)  # idle and warm
        _reset(client)
        count = int(LATENCY_RATE * LATENCY_SECONDS)
        began = time.monotonic()
        for i in range(count):
            delay = began + i / LATENCY_RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pipe = client.pipeline(transaction=False)  # with its wake-up marker, as every publish of the pipeline
            pipe.lpush(system.queue, clone(message, time.time()))
            wake.mark(pipe, system.queue)
            pipe.execute()
        _wait_done(client, count)
        lat = sorted(float(x) for x in client.lrange(f"{KEY}:lat", 0, -1))
    finally:
        workers.stop()
    return {
        "drain": drain,
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--queue", default="email")
    parser.add_argument("--only", default="", help="comma-separated substrings of system names")
    parser.add_argument("--baseline", default="", help="also run the chosen pipeline systems from this checkout")
    parser.add_argument("--json", dest="json_out", default="", help="also write the medians to this file")
    opts = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the workers and Redis on the way out
    chosen = [s for s in systems(opts.queue) if not opts.only or any(o in s.name for o in opts.only.split(","))]
    if opts.baseline:
        root = Path(opts.baseline).resolve()
        chosen += [replace(s, name=f"{s.name} [{root.name}]", root=root) for s in chosen if s.app == "app"]
    results: dict[str, list[dict[str, float]]] = {s.name: [] for s in chosen}
    with redis_server() as url:
        os.environ["REDIS_URL"] = url
        for rep in range(opts.reps):
            for system in chosen:
                try:
                    figures = run_once(system, url, opts.jobs)
                except (RuntimeError, TimeoutError) as exc:
                    print(f"rep {rep + 1} {system.name}: FAILED {str(exc)[-300:]}", flush=True)
                    continue
                results[system.name].append(figures)
                print(f"rep {rep + 1} {system.name}: {figures}", flush=True)
    medians = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items() if runs
    }
    base = medians.get(chosen[0].name)
    print(f"\n{'system':<56} {'drain/s':>8} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99 ratio':>9}")
    for name, m in medians.items():
        ratio = m["drain"] / base["drain"] if base else float("nan")
        p99 = m["p99_ms"] / base["p99_ms"] if base else float("nan")
        print(f"{name:<56} {m['drain']:>8.0f} {ratio:>6.2f} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f} {p99:>9.2f}")
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
