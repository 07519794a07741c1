"""Real processes for tests: a throwaway redis-server, Celery workers and any other command, each stopped by PID.

Nothing here touches the developer's Redis on 6379 or any process it did not start itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, Self, TypeVar

import redis

from pipeline.cli.redis_bin import redis_binary

SIGKILL = signal.SIGKILL  # a module name: `Worker.signal` shadows `signal` inside the class body

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def waiting(client: redis.Redis, queue: str) -> int:
    """Jobs waiting in `queue`, every priority level (kombu's list per level)."""
    from pipeline.broker import queue_keys

    return sum(int(client.llen(key)) for key in queue_keys(queue))


class Service(Protocol):
    def start(self) -> object: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=Service)


def running(service: S) -> Iterator[S]:
    """A fixture's body for a server or process: `yield from running(X(...))` starts it, hands it to the tests and
    stops it after them."""
    service.start()
    yield service
    service.stop()


def wait_for(
    predicate: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition"
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_progressing(
    count: Callable[[], int], target: int, stalled: float, interval: float = 0.2, what: str = ""
) -> int:
    """Wait until `count()` reaches `target` for as long as it keeps growing: a loaded machine is slow, not stuck. Fails
    after `stalled` seconds without any growth."""
    last, since = count(), time.monotonic()
    while last < target:
        time.sleep(interval)
        now = count()
        if now > last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stalled:
            raise TimeoutError(f"{what or 'the count'} stalled at {last} of {target} for {stalled}s")
    return last


def run_python(env: Mapping[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python ARGV` from the repository's root in a process of its own, with `env` over this one's: its exit code,
    stdout and stderr (a test on a Redis Cluster runs its clients so, with the cluster's settings)."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 10) -> None:
    """SIGTERM `proc` and wait; SIGKILL it if it outlives `timeout` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def ask(proc: subprocess.Popen[str], op: str, args: Mapping[str, Any]) -> dict[str, Any] | None:
    """One request to a child answering JSON lines on stdin/stdout: `{"op": op, **args}` out, its reply back (None
    when it exited instead of answering)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    return dict(json.loads(line)) if line else None


def spawn_redis(argv: list[str], client: Callable[[], redis.Redis], what: str) -> subprocess.Popen[bytes]:
    """Start redis-server `argv` in its own session and wait until `client()` answers PING."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def ready() -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(client().ping())
        return False

    wait_for(ready, 15, what=what)
    return proc


class RedisServer:
    """redis-server on a free loopback port with AOF under `directory`."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self.proc = spawn_redis(argv, self.client, f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


class Worker:
    """`celery -A tests.support.worker_app worker` in its own session, logging to a file."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        env: Mapping[str, str],
        *,
        queues: str | None = None,
        concurrency: int = 2,
        pool: str = "prefork",
        extra: tuple[str, ...] = (),
        mingle: bool = False,
    ) -> None:
        """`mingle`: sync with the workers already up at start, as `celery worker` does by default (a control
        broadcast whose replies come back on `reply.celery.pidbox`); off unless a test is about it."""
        self.name = name
        self.log_path = log_dir / f"worker-{name}.log"
        self.env = {**os.environ, **env}
        self.argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.worker_app",
            "worker",
            "-n",
            f"{name}@%h",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-l",
            "INFO",
            "--without-gossip",
            *(() if mingle else ("--without-mingle",)),
            *extra,
        ]
        if queues:
            self.argv += ["-Q", queues]
        self.proc: subprocess.Popen[bytes] | None = None
        self.terminated = False

    def start(self, timeout: float = 60) -> Worker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.terminated = False
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        wait_for(
            lambda: " ready." in self.log() or self.proc.poll() is not None,
            timeout,
            0.1,
            what=f"worker {self.name} to be ready",
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited at start:\n{self.log()[-4000:]}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self, sig: int = SIGKILL) -> None:
        """Signal the worker's whole process group (main process and pool children)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        """Send SIGTERM (the worker starts its shutdown); `stop()` waits for it."""
        if self.proc is not None and self.proc.poll() is None and not self.terminated:
            self.proc.terminate()
            self.terminated = True

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill_group(signal.SIGKILL)  # pool children left behind, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None


class Command:
    """A command (a worker command, beat, the exporter, `pipeline run`) in its own session, its output in `log_path`.

    `stop` sends SIGTERM, waits, then SIGKILLs its process group by PID (what it started there and left); a command
    that starts children in sessions of their own (`pipeline run`) stops them itself on SIGTERM."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.argv, self.log_path = list(argv), log_path
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = self._popen(log)
        return self

    def _popen(self, log: IO[bytes]) -> subprocess.Popen[Any]:
        """The command started, its output in `log` (a subclass may talk to it over pipes instead)."""
        return subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 40) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what it started and left, if anything
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None
