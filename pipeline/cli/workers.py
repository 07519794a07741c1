"""`pipeline worker --processes N`: the I/O profile, N Celery worker processes under one supervisor.

By default each runs the asyncio pool (`-P custom`, `pipeline.runtime.asyncpool`): WORKER_CONCURRENCY jobs in flight
per process, `async def` tasks' coroutines on an event loop, plain ones as a solo worker runs them. `--pool solo` runs
the earlier model described below: one job at a time per process. N defaults to one per CPU plus one for both.

Why (docs/deployment.md, "Worker profiles", measured with `bench/worker_profiles.py`): a short job is mostly the
worker's own bookkeeping (fetch, unacked record, result, ack), so what bounds throughput is Python CPU
per job. A prefork worker pays it twice (its main process fetches, acknowledges and talks to the child
over a pipe; the child runs and stores the result) and its main process is the bottleneck; a threads
pool shares one interpreter lock. N solo workers each do everything in one process, one job at a time,
and use N cores; their start latency stays at the round trip. The default N is one more than the CPUs the
supervisor may use (`default_processes`: its affinity, or its container's CPU quota when lower): a solo worker
waits for each Redis round trip (its job's own, its fetch), and a third worker on two cores keeps both busy
meanwhile (measured: about 10 % more jobs/s than two, fewer with four). Time limits hold in them through a timer
in the main thread (`pipeline.runtime.timelimits`).

The supervisor starts `celery -A <app> worker -P solo -n <name><i>@%h <args>` N times, each in its own
session, with one prometheus-client multiprocess directory (PROMETHEUS_MULTIPROC_DIR, else one under
DATA_DIR) and no METRICS_PORT of their own: the supervisor serves their figures added up on METRICS_PORT
and sweeps the files of processes that are gone. A worker that exits on its own is started again (after
a second; a worker that refuses to start, exit status 2, stops them all with status 2). SIGTERM or SIGINT
is passed to every worker, which drains as any Celery worker does (REMAP_SIGTERM=SIGQUIT: running jobs get
WORKER_SOFT_SHUTDOWN_TIMEOUT), then the supervisor exits; a worker left after that bound is killed.
Each worker writes its own heartbeat file: `pipeline worker-health --node '<name>*@%h'` checks them all.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.config import get_settings
from pipeline.observability import endpoint
from pipeline.runtime.asyncpool import POOL

#: Exit status of a Celery worker that refused to start (a bad setting, the DLQ among its queues).
EX_REFUSED = 2
RESTART_DELAY_S = 1.0
#: Where a container sees its own control group (its CPU quota).
CGROUP = Path("/sys/fs/cgroup")


def metrics_directory() -> Path:
    """PROMETHEUS_MULTIPROC_DIR if set (the start scripts wipe it), else DATA_DIR/metrics-workers, emptied."""
    settings = get_settings()
    if settings.prometheus_multiproc_dir is not None:
        return settings.prometheus_multiproc_dir
    directory = (settings.data_dir / "metrics-workers").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    return directory


def quota_cpus(cgroup: Path = CGROUP) -> int | None:
    """The CPUs a CFS quota gives this container, rounded up (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`, as Docker's `--cpus` and a Kubernetes CPU limit set them); None when there is none."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        allowed, per = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return max(1, math.ceil(allowed / per)) if allowed > 0 and per > 0 else None


def allowed_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: those its affinity mask allows (which cpusets narrow), or fewer when a CFS
    quota gives it fewer."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cpus = os.cpu_count() or 1
    return min(cpus, quota_cpus(cgroup) or cpus)


def default_processes(cgroup: Path = CGROUP) -> int:
    """One worker per CPU, plus one: a worker's main thread waits for each Redis round trip of its jobs' bookkeeping
    (solo, and the asyncio pool's too), and a third worker on two cores keeps both busy meanwhile."""
    return allowed_cpus(cgroup) + 1


def worker_argv(app: str, name: str, index: int, celery_args: list[str], pool: str = "asyncio") -> list[str]:
    node = f"{name}{index}@%h"
    # `-P custom` is Celery's out-of-tree pool: the class CELERY_CUSTOM_WORKER_POOL names (set by the Supervisor).
    pool_args = ["-P", "solo", "-c", "1"] if pool == "solo" else ["-P", "custom"]
    return [sys.executable, "-m", "celery", "-A", app, "worker", *pool_args, "-n", node, *celery_args]


class Supervisor:
    def __init__(self, app: str, name: str, processes: int, celery_args: list[str], pool: str = "asyncio") -> None:
        self.argvs = [worker_argv(app, name, i + 1, celery_args, pool) for i in range(processes)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * processes
        self.stopping = threading.Event()
        directory = metrics_directory()
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "REMAP_SIGTERM": "SIGQUIT"}
        if pool != "solo":
            self.env["CELERY_CUSTOM_WORKER_POOL"] = POOL
        self.env.pop("METRICS_PORT", None)
        self.directory = directory

    def start(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(self.argvs[index], env=self.env, start_new_session=True)

    def run(self) -> int:
        settings = get_settings()
        if settings.metrics_port is not None:
            endpoint.serve(self.directory, settings.metrics_port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        for index in range(len(self.procs)):
            self.start(index)
        code = 0
        while not self.stopping.wait(0.5):
            for index, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None:
                    continue
                if proc.returncode == EX_REFUSED:
                    print(f"pipeline worker: worker {index + 1} refused to start; stopping", file=sys.stderr)
                    self.stopping.set()
                    code = EX_REFUSED
                    break
                print(f"pipeline worker: worker {index + 1} exited ({proc.returncode}); restarting", file=sys.stderr)
                time.sleep(RESTART_DELAY_S)
                self.start(index)
        self.stop(settings.worker_soft_shutdown_timeout + 15)
        return code

    def stop(self, grace: float) -> None:
        running = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # past the bound, or a leftover of its session
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def run_workers(app: str, name: str, processes: int, celery_args: list[str], pool: str = "asyncio") -> int:
    return Supervisor(app, name, processes, celery_args, pool).run()
