"""`python -m tests.celery_suite [VARIANT ...] [-n N] [-- PYTEST_ARGS]`: Celery's integration suite per variant.

With no variant: the pipeline's (`make test-celery`); `stock-prefork` is the baseline (`make test-celery-stock`).
Prints one summary line per variant and exits non-zero when any run failed (a new failure, a listed test passing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.celery_suite.sdist import ROOT, fetch

HERE = Path(__file__).resolve().parent
#: Celery's modules the issue names (the others test beat, loaders, other backends and memory). Not
#: test_backend.py: its two tests are Azure Blob's (skipped without AZUREBLOCKBLOB_URL) and it imports the Azure SDK.
SUITE = ("test_canvas.py", "test_tasks.py", "test_inspect.py", "test_redis_backend.py", "test_worker.py")
#: Our canvas checks, copied into the suite under this name (`suite_pools`).
POOLS = "test_pipeline_pools.py"
PIPELINE_APP = "tests.celery_suite.pipeline_worker"
POOL_CLASSES = {
    "prefork": "celery.concurrency.prefork:TaskPool",
    "solo": "celery.concurrency.solo:TaskPool",
    "custom": "pipeline.runtime.asyncpool:AsyncPool",
}


@dataclass(frozen=True)
class Variant:
    app: str
    pool: str
    modules: tuple[str, ...]
    #: pytest-xdist processes at most (each with its own Redis and worker).
    processes: int = 8


VARIANTS = {
    "stock-prefork": Variant("tests.celery_suite.stock_worker", "prefork", SUITE),
    "pipeline-prefork": Variant(PIPELINE_APP, "prefork", (*SUITE, POOLS)),
    "pipeline-asyncio": Variant(PIPELINE_APP, "custom", (*SUITE, POOLS)),
    "pipeline-solo": Variant(PIPELINE_APP, "solo", (POOLS,), processes=1),
}
DEFAULT = ("pipeline-prefork", "pipeline-asyncio", "pipeline-solo")
SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?|deselected)\b.*) in [\d.]+s")


def stop_leftovers(pids: Path) -> None:
    """SIGKILL the process groups a run started (redis-server, the workers) that outlived it, by their PIDs."""
    if pids.exists():
        for pid in pids.read_text().split():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
        pids.unlink()


def start(name: str, suite: Path, processes: int, extra: list[str], logs: Path) -> Run:
    """Start one variant's pytest, its output into `logs/<name>.log`."""
    variant = VARIANTS[name]
    pids = logs / f"{name}.pids"
    env = {**os.environ, "CELERY_SUITE_VARIANT": name, "CELERY_SUITE_APP": variant.app, "CELERY_SUITE_PIDS": str(pids)}
    env.update(CELERY_SUITE_POOL=variant.pool, CELERY_SUITE_POOL_CLASS=POOL_CLASSES[variant.pool])
    env["PYTHONPATH"] = os.pathsep.join([str(suite), str(ROOT)])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `celery` for the suite
    argv = [sys.executable, "-m", "pytest", "-c", str(HERE / "suite.ini"), "--rootdir", str(suite)]
    processes = min(processes, variant.processes)
    if processes > 1:
        argv += ["-n", str(processes), "--dist", "load"]
        env["CELERY_SUITE_XDIST"] = "1"
    argv += [f"t/integration/{module}" for module in variant.modules] + extra
    log = logs / f"{name}.log"
    print(f"celery suite {name}: pytest {' '.join(argv[3:])} > {log}", flush=True)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Run(name, proc, log, pids, time.monotonic())


@dataclass
class Run:
    name: str
    proc: subprocess.Popen[str]
    log: Path
    pids: Path
    started: float
    wall: float = 0.0

    def wait(self) -> int:
        code = self.proc.wait()
        self.wall = time.monotonic() - self.started
        stop_leftovers(self.pids)
        return code

    def stop(self) -> None:
        """Stopped from outside (the step's budget): pytest stops its workers; whatever is left is killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        stop_leftovers(self.pids)

    def report(self) -> tuple[str, str]:
        """The log from pytest's short summary on, and the count line."""
        text = self.log.read_text(errors="replace")
        tail = text[text.rfind("short test summary info") :] if "short test summary info" in text else text[-3000:]
        counts = [found.group(1) for found in map(SUMMARY.match, text.splitlines()) if found]
        return tail, counts[-1] if counts else "no summary"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.celery_suite", description=__doc__)
    parser.add_argument("variants", nargs="*", choices=[*VARIANTS, []], default=[])
    parser.add_argument("-n", "--processes", type=int, default=4, help="pytest-xdist processes per variant")
    parser.add_argument("--cache", type=Path, default=ROOT / ".data" / "celery-suite", help="where the sdist goes")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:split]), argv[split + 1 :]
    suite = fetch(args.cache)
    shutil.copyfile(HERE / "suite_pools.py", suite / "t" / "integration" / POOLS)
    logs = args.cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The variants run side by side: their tests mostly wait on the worker, each variant on its own Redis.
    runs = [start(name, suite, args.processes, extra, logs) for name in args.variants or DEFAULT]

    def stop_all(signum: int, frame: object) -> None:
        for each in runs:
            each.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop_all)
    codes = [each.wait() for each in runs]
    for each, code in zip(runs, codes, strict=True):
        tail, _ = each.report()
        print(f"\n----- {each.name} (exit {code}, {each.log}) -----\n{tail}")
    print("celery suite results")
    for each, code in zip(runs, codes, strict=True):
        print(f"  {each.name:18} {'ok  ' if code == 0 else 'FAIL'} {each.report()[1]} ({each.wall:.0f} s)")
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
