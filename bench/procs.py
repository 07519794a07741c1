"""Throwaway processes for benchmarks: redis-server on a free port and Celery workers, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from pipeline.cli.redis_bin import redis_binary

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
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
        proc.wait(10)


class Worker:
    def __init__(self, app: str, queue: str, concurrency: int) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-worker-", suffix=".log")[1])
        self.argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-Q",
            queue,
            "-c",
            str(concurrency),
            "-P",
            "prefork",
            "-l",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"{queue}@%h",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and return the monotonic time at which the worker reported ready."""
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*self.argv, "-l", "INFO"],
                cwd=ROOT,
                env=os.environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while " ready." not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.01)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        self.log.unlink(missing_ok=True)
