"""Many I/O-bound jobs in flight: webhook deliveries to a slow endpoint, the pipeline against stock Celery and BullMQ.

    python -m bench io_concurrency [--jobs 3000] [--latency 0.1] [--reps 3] [--json] [--io-worker COMMAND ...]
    python -m bench io_concurrency --latency 2 --jobs 1000 --reps 1     # how many in flight at once (target >= 400)

Method (../shared/reference/io-concurrency.md). One throwaway Redis and one local endpoint (`bench.io_endpoint`, a
process of its own) answering every POST with 200 after `--latency` seconds; it counts arrivals and the peak number
of requests in flight at once. Three systems, each delivering N webhook jobs (a signed JSON POST to
127.0.0.1:PORT/hooks/i):

* pipeline: the I/O worker command line (`--io-worker`, repeatable for several processes; default
  `pipeline worker -Q webhooks --loglevel WARNING`) running the shipped `webhooks.deliver`, the jobs enqueued by
  `tasks.webhooks.enqueue_many`; 127.0.0.1 allowed (WEBHOOK_ALLOWED_HOSTS), WEBHOOK_SIGNING_SECRET set, and
  WEBHOOK_RATE_PER_HOST far above any rate reached so the cluster-wide limit never binds;
* stock Celery, default settings, `-P threads -c 50`: `stock.webhook` (bench/stock_app.py), one pooled
  `httpx.Client` shared by the threads, the jobs sent by `delay()`;
* BullMQ: a Worker with concurrency 50 in one Node process POSTing with global `fetch` (bench/node/bullmq_io.js), the
  jobs added by `addBulk`; bullmq and ioredis are installed by npm into BENCH_CACHE_DIR (default
  ~/.cache/pipeline-bench), never into the repository.

Per system and rep: Redis flushed, the endpoint's counts zeroed and its gate closed; the worker started and ready
(Celery nodes answer a ping: as many as `--processes` gives, else as many as have answered for 4 s unchanged; the
Node worker says so); the N jobs enqueued by a producer process of the system's own. Deliveries reaching the closed
gate are held there; once their number has stayed the same for 2 s (every process booted, every slot taken, the
producer done) the gate opens and the clock starts: worker boot, a slow producer and processes booting one after the
other are all out of the figures. Done when N deliveries arrived and none is in flight (or after `--io-timeout`
seconds: the figures then cover what arrived, marked partial). Figures: jobs/s = arrivals / (last arrival - gate
opening); the endpoint's peak in flight; the peak summed RSS of the worker's whole process tree (psutil, sampled
every 0.2 s from its readiness to its stop: see `RssSampler`); jobs/s per GiB of that RSS; the CPU time (user +
system) the tree used from the gate's opening to the end, per job delivered; the share of the endpoint's limit
reached (jobs/s against peak in flight / latency) and a slot's time per job beside the endpoint's own mean answer
(its worker-side overhead). Systems interleaved rep by rep, medians of the reps; ratios of the pipeline to BullMQ and
to stock Celery. Progress on stderr. Not a test: nothing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from bench.procs import ROOT, Workers, bench_env, free_port

SYSTEMS = ("pipeline", "stock", "bullmq")
LABELS = {
    "pipeline": "pipeline (I/O worker)",
    "stock": "stock Celery threads c50",
    "bullmq": "BullMQ concurrency 50",
}
DEFAULT_IO_WORKER = ["pipeline worker -Q webhooks --loglevel WARNING"]
STOCK_WORKER = "celery -A bench.stock_app worker -P threads -c 50 --loglevel WARNING"
PEER_CONCURRENCY = 50
NODE_DIR = ROOT / "bench" / "node"
SECRET = "bench-io-concurrency-signing-secret"  # noqa: S105  # signs POSTs to the throwaway endpoint only
#: With a supervisor's default number of processes: the nodes answering a ping stay as many this long, then ready.
NODES_STABLE_S = 4.0
#: The held deliveries' count stays the same this long before the gate opens.
HOLD_STABLE_S = 2.0
GIB = float(1 << 30)
MIB = float(1 << 20)


@dataclass
class Options:
    jobs: int = 3000
    latency: float = 0.1
    reps: int = 3
    timeout: float = 900.0
    pipeline: list[str] = field(default_factory=lambda: list(DEFAULT_IO_WORKER))


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _argv(command: str) -> list[str]:
    """A command line split as a shell would; `celery` and `pipeline` are the virtualenv's, `node` from PATH."""
    argv = shlex.split(command)
    if argv and argv[0] in ("celery", "pipeline"):
        argv[0] = os.path.join(os.path.dirname(sys.executable), argv[0])
    elif argv and argv[0] == "node":
        argv[0] = shutil.which("node") or "node"
    return argv


def celery_nodes(argv: list[str]) -> int | None:
    """Celery nodes a command line starts: 1 for `celery worker`, `--processes` for `pipeline worker`; None when that
    is left to the supervisor's default (which the pool chooses: the benchmark does not second-guess it)."""
    if Path(argv[0]).name != "pipeline" or "worker" not in argv[1:2]:
        return 1
    for i, arg in enumerate(argv):
        if arg == "--processes" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--processes="):
            return int(arg.split("=", 1)[1])
    return None


def node_modules() -> Path:
    """bench/node/package.json's packages, installed by npm into the cache directory (again only when it changed)."""
    cache = Path(os.environ.get("BENCH_CACHE_DIR") or Path.home() / ".cache" / "pipeline-bench") / "node"
    cache.mkdir(parents=True, exist_ok=True)
    wanted = (NODE_DIR / "package.json").read_text()
    stamp = cache / "node_modules" / ".bench-installed"
    if not stamp.is_file() or stamp.read_text() != wanted:
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is not on PATH: the BullMQ side needs node 20+ and npm")
        say(f"  installing bullmq into {cache} (npm)")
        (cache / "package.json").write_text(wanted)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel", "error"], cwd=cache, check=True)
        stamp.write_text(wanted)
    return cache / "node_modules"


class Endpoint:
    """`bench.io_endpoint` in a process of its own, and a client for its counts."""

    def __init__(self, latency: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.io_endpoint", str(self.port), str(latency)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.client = httpx.Client(base_url=self.url, trust_env=False, timeout=10)
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                self.stats()
                return
            time.sleep(0.05)
        raise RuntimeError("the endpoint did not start")

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = self.client.get("/stats").json()
        return data

    def reset(self) -> None:
        """Zero the counts and close the gate."""
        self.client.post("/reset")

    def open(self) -> None:
        self.client.post("/open")

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


class RssSampler(threading.Thread):
    """Peak summed RSS of the process trees under `pids` once `measuring` is set (the workers are ready: while they
    boot, each Celery process forks `uname -p` for its banner, and the child, sharing all its parent's pages until it
    execs, would count them twice); every PID seen, for the clean-up; their CPU time."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.peak = 0
        self.seen: set[int] = set()
        self.done = threading.Event()
        self.measuring = threading.Event()

    def tree(self) -> list[psutil.Process]:
        procs = []
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
        return procs

    def sample(self) -> None:
        total = 0
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                self.seen.add(proc.pid)
                total += proc.memory_info().rss
        if self.measuring.is_set():
            self.peak = max(self.peak, total)

    def cpu_seconds(self) -> float:
        """User + system CPU time the trees' processes have used so far."""
        total = 0.0
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        self.join(5)


class Bench:
    def __init__(self, url: str, options: Options, endpoint: Endpoint) -> None:
        self.url = url
        self.options = options
        self.endpoint = endpoint
        self.redis = redis.Redis.from_url(url)
        self.env = {**bench_env(url), "BENCH_WEBHOOK_SECRET": SECRET}
        self.data = Path(tempfile.mkdtemp(prefix="bench-io-"))
        self.pipeline_env = {
            **self.env,
            "WEBHOOK_SIGNING_SECRET": SECRET,
            "WEBHOOK_ALLOWED_HOSTS": '["127.0.0.1"]',
            "WEBHOOK_RATE_PER_HOST": "1000000/s",
            "WEBHOOK_TIMEOUT": "60",  # held at the closed gate for a few seconds: no read times out meanwhile
            "DATA_DIR": str(self.data),
            "WORKER_HEALTH_DIR": str(self.data),
        }
        self.node_env = {**self.env, "NODE_PATH": str(node_modules())}

    def commands(self, system: str) -> list[str]:
        if system == "pipeline":
            return self.options.pipeline
        if system == "stock":
            return [STOCK_WORKER]
        return [f"node {NODE_DIR / 'bullmq_io.js'} work {PEER_CONCURRENCY}"]

    def produce(self, system: str) -> dict[str, Any]:
        n, endpoint = self.options.jobs, self.endpoint.url
        if system == "bullmq":
            argv, env = _argv(f"node {NODE_DIR / 'bullmq_io.js'} produce {n} {endpoint}"), self.node_env
        else:
            argv = [sys.executable, "-m", "bench.io_producer", system, str(n), endpoint]
            env = self.pipeline_env if system == "pipeline" else self.env
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"producer {system}: {done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def wait_ready(self, system: str, workers: Workers, argvs: list[list[str]]) -> None:
        deadline = time.monotonic() + 120
        if system == "bullmq":
            while "ready" not in workers.logs[0].read_text():
                workers.check()
                if time.monotonic() > deadline:
                    raise TimeoutError("the BullMQ worker did not get ready")
                time.sleep(0.1)
            return
        from celery import Celery

        control = Celery("bench-io-control", broker=self.url).control
        counts = [celery_nodes(argv) for argv in argvs]
        expected = sum(c for c in counts if c is not None)
        answered, since = -1, time.monotonic()
        while True:
            count = len(control.ping(timeout=0.5))
            now = time.monotonic()
            if count != answered:
                answered, since = count, now
            # a known number of nodes: all of them; else (a supervisor's default) as many as answer, for NODES_STABLE_S
            if answered >= expected and (None not in counts or (answered > 0 and now - since >= NODES_STABLE_S)):
                return
            workers.check()
            if now > deadline:
                raise TimeoutError(f"{system}: {answered} worker nodes answer a ping ({expected} expected at least)")

    def run(self, system: str, label: str) -> dict[str, Any]:
        self.redis.flushdb()
        self.endpoint.reset()
        argvs = [_argv(c) for c in self.commands(system)]
        env = {"pipeline": self.pipeline_env, "stock": self.env, "bullmq": self.node_env}[system]
        workers = Workers(argvs, env).start()
        sampler = RssSampler([p.pid for p in workers.procs])
        sampler.start()
        try:
            self.wait_ready(system, workers, argvs)
            sampler.measuring.set()
            self.produce(system)
            self.open_when_full(workers, label)
            cpu = sampler.cpu_seconds()
            stats, partial = self.wait_delivered(workers, label)
            cpu = sampler.cpu_seconds() - cpu
        finally:
            sampler.stop()
            stop(workers, sampler.seen)
        return figures(stats, sampler.peak, cpu, partial, self.options.latency)

    def open_when_full(self, workers: Workers, label: str) -> None:
        """Open the endpoint's gate once the held deliveries' count has stayed the same for HOLD_STABLE_S."""
        deadline = time.monotonic() + 120
        held, since = -1, time.monotonic()
        while True:
            now = time.monotonic()
            count = self.endpoint.stats()["in_flight"]
            if count != held:
                held, since = count, now
            elif held > 0 and now - since >= HOLD_STABLE_S:
                break
            workers.check()
            if now > deadline:
                raise TimeoutError(f"{label}: {held} deliveries held, still changing or none")
            time.sleep(0.1)
        say(f"  {label}: {held} deliveries held at the gate; open")
        self.endpoint.open()

    def wait_delivered(self, workers: Workers, label: str) -> tuple[dict[str, Any], bool]:
        n = self.options.jobs
        began = time.monotonic()
        shown = began
        while True:
            stats = self.endpoint.stats()
            if stats["arrivals"] >= n and stats["in_flight"] == 0:
                return stats, False
            workers.check()
            now = time.monotonic()
            if now - began > self.options.timeout:
                say(f"  {label}: timed out after {self.options.timeout:.0f} s; figures over what arrived")
                return stats, True
            if now - shown >= 5:
                shown = now
                say(
                    f"  {label}: {stats['arrivals']:,}/{n:,} arrived, {stats['in_flight']} in flight "
                    f"(peak {stats['peak_in_flight']}), {now - began:.0f} s"
                )
            time.sleep(0.25)


def stop(workers: Workers, seen: set[int]) -> None:
    """Stop the workers (TERM to each one's group, as `bench.procs` does), then any process of their trees left
    (the `pipeline worker` supervisor's workers run in sessions of their own), by PID."""
    roots = {p.pid for p in workers.procs}
    workers.stop()
    left = []
    for pid in seen - roots:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            left.append(proc)
    _gone, alive = psutil.wait_procs(left, timeout=20)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def figures(stats: dict[str, Any], rss: int, cpu: float, partial: bool, latency: float) -> dict[str, Any]:
    """One rep's figures. `of_limit`: the rate against what the peak in flight allows at the endpoint's latency
    (concurrency / latency); `worker_ms_per_job`: how long a slot spends per job beside the endpoint's answer
    (peak in flight / rate, less the endpoint's mean time from a delivery's arrival to its answer)."""
    arrivals = stats["arrivals"]
    span = (stats["last"] or 0.0) - (stats["first"] or 0.0)
    rate = arrivals / span if span > 0 else math.nan
    peak = stats["peak_in_flight"]
    answer = stats.get("mean_answer_s") or latency
    return {
        "jobs_per_s": rate,
        "of_limit": rate * latency / peak if peak else math.nan,
        "worker_ms_per_job": 1000 * (peak / rate - answer) if peak and rate > 0 else math.nan,
        "peak_in_flight": stats["peak_in_flight"],
        "rss_mib": rss / MIB,
        "jobs_per_s_per_gib": rate / (rss / GIB) if rss else math.nan,
        "cpu_ms_per_job": 1000 * cpu / arrivals if arrivals else math.nan,
        "arrivals": arrivals,
        "duplicates": arrivals - stats["distinct"],
        "seconds": span,
        "partial": partial,
    }


def measure(url: str, options: Options) -> dict[str, Any]:
    endpoint = Endpoint(options.latency)
    bench = Bench(url, options, endpoint)
    reps: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    load = os.getloadavg()[0]
    try:
        for rep in range(options.reps):
            for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                label = f"rep {rep + 1}/{options.reps} {system}"
                say(f"  {label}: {' + '.join(bench.commands(system))}")
                reps[system].append(bench.run(system, label))
                r = reps[system][-1]
                say(f"  {label}: {r['jobs_per_s']:.1f} jobs/s, {r['peak_in_flight']} in flight, {r['rss_mib']:.0f} MiB")
    finally:
        endpoint.stop()
        shutil.rmtree(bench.data, ignore_errors=True)
    names = tuple(key for key, _, _ in ROWS)
    medians = {s: {k: statistics.median(r[k] for r in runs) for k in names} for s, runs in reps.items()}
    for system, runs in reps.items():
        medians[system]["partial"] = any(r["partial"] for r in runs)
    ours = medians["pipeline"]
    ratios = {peer: {k: ours[k] / medians[peer][k] for k in names} for peer in ("bullmq", "stock")}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jobs": options.jobs,
        "latency_s": options.latency,
        "reps": options.reps,
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "workers": {s: bench.commands(s) for s in SYSTEMS},
        "median": medians,
        "ratios": ratios,
        "all_reps": reps,
    }


ROWS = (
    ("jobs_per_s", "jobs/s", "{:,.1f}"),
    ("peak_in_flight", "peak in flight", "{:,.0f}"),
    ("rss_mib", "peak RSS (MiB)", "{:,.0f}"),
    ("jobs_per_s_per_gib", "jobs/s per GiB", "{:,.0f}"),
    ("cpu_ms_per_job", "CPU ms per job", "{:,.1f}"),
    ("of_limit", "of its limit", "{:,.2f}"),
    ("worker_ms_per_job", "slot ms beside", "{:,.1f}"),
)


def table(result: dict[str, Any]) -> str:
    medians, ratios = result["median"], result["ratios"]
    width = 28
    lines = [f"{'':{width}}" + "".join(f"{label:>16}" for _, label, _ in ROWS)]
    for system in SYSTEMS:
        cells = "".join(f"{fmt.format(medians[system].get(k, math.nan)):>16}" for k, _, fmt in ROWS)
        lines.append(f"{LABELS[system] + (' *' if medians[system]['partial'] else ''):{width}}{cells}")
    for peer in ("bullmq", "stock"):
        cells = "".join(f"{ratios[peer].get(k, math.nan):>15.2f}x" for k, _, _ in ROWS)
        lines.append(
            f"{'pipeline ÷ ' + LABELS[peer].split(' ')[0] + (' Celery' if peer == 'stock' else ''):{width}}{cells}"
        )
    ceiling = PEER_CONCURRENCY / result["latency_s"]
    lines += [
        "",
        f"{result['date']}: {result['jobs']:,} webhook jobs per system, endpoint latency "
        f"{result['latency_s'] * 1000:g} ms; medians of {result['reps']}, systems interleaved; {result['cpus']} CPUs, "
        f"load average {result['load_average_at_start']:.1f} at start, "
        f"{result.get('load_average_at_end', math.nan):.1f} at end. "
        "jobs/s from the gate's opening to the last arrival at the endpoint; RSS: peak summed RSS of the worker's "
        "process tree from its readiness to its stop; CPU: the tree's, from the gate's opening to the end, per job.",
        "Of its limit: jobs/s against peak in flight / latency (target >= 0.8 at 100 in flight); slot ms beside: a "
        "slot's time per job beside the endpoint's mean answer (peak in flight / jobs/s - mean answer); both read a "
        "run many latencies long (a short one is skewed by its first and last waves). "
        "Ratios are pipeline ÷ peer (peak RSS, CPU: higher is more). "
        f"50 in flight at this latency can reach {ceiling:,.0f} jobs/s. Target: peak in flight >= 400 for the "
        "pipeline's default I/O worker (--latency 2 --jobs 1000).",
    ]
    if any(medians[s]["partial"] for s in SYSTEMS):
        lines.append("* partial: timed out (--io-timeout) before every job arrived; figures over what arrived")
    for system in SYSTEMS:
        lines.append(f"{system} worker: {' + '.join(result['workers'][system])}")
    return "\n".join(lines)


def main(options: Options | None = None, as_json: bool = False) -> dict[str, Any]:
    """Run on the Redis of REDIS_URL (`python -m bench` starts a throwaway one); print the table or the JSON."""
    result = measure(os.environ["REDIS_URL"], options or Options())
    print(json.dumps(result, indent=2) if as_json else table(result), flush=True)
    return result
