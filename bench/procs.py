"""Throwaway processes for benchmarks: redis-server on a free port and Celery workers, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from pipeline.cli.redis_bin import redis_binary

ROOT = Path(__file__).resolve().parents[1]


def bench_env(url: str) -> dict[str, str]:
    """The environment of a benchmark's processes: the throwaway Redis at `url`, none of the caller's Redis, Celery
    or pipeline settings (only the pipeline's processes read REDIS_URL and its settings)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "REDIS_", "PIPELINE_"))}
    env = {**base, "BENCH_REDIS_URL": url, "REDIS_URL": url, "ENV_FILE": "", "SECRETS_DIR": "/nonexistent"}
    env.update(LOG_LEVEL="WARNING", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])))
    return env


def run_producer(env: dict[str, str], system: str, *args: object, module: str = "bench.producer") -> dict[str, Any]:
    """One `bench.producer` (or `module`) measurement in a process of its own; its JSON line."""
    done = subprocess.run(
        [sys.executable, "-m", module, system, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"producer {system} {args}: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[str]:
    """A throwaway redis-server (`pipeline.cli.redis_bin`), no persistence unless `extra` options (which override
    the defaults) ask for it; its directory is removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                break
        time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


class Workers:
    """Worker processes started from command lines (each split like a shell would), stopped by process group."""

    def __init__(self, commands: list[list[str]], env: dict[str, str]) -> None:
        self.commands = commands
        self.env = env
        self.logs: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Workers:
        for argv in self.commands:
            log = Path(tempfile.mkstemp(prefix="bench-worker-", suffix=".log")[1])
            self.logs.append(log)
            with log.open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        return self

    def check(self) -> None:
        """Raise with its log if a worker exited."""
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {proc.args!r} exited {proc.returncode}:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for log in self.logs:
            log.unlink(missing_ok=True)
        self.procs.clear()
        self.logs.clear()
