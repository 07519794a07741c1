"""A replicated Redis for tests, and a producer process pointed at it.

* `Replicated`: a primary and one replica (`redis-server --replicaof`) on free loopback ports, each stopped by PID;
  `frozen()` stops the replica with SIGSTOP (its link stays open, it confirms nothing) and resumes it after.
* `ProducerProcess`: one long-lived interpreter whose settings point at a Redis of the test's own (REDIS_URL,
  REDIS_WAIT_REPLICAS, ...), answering calls of the producer side one JSON line at a time: typed enqueue and
  enqueue_many, DLQ replay, the delayed-job release and the `pipeline` command (typer's runner, in that process).
  The test process's own settings and Celery app stay on the session's Redis. Run as
  `python -m tests.support.replicas`, it is that server: a request `{"op": ..., ...}` per line on stdin, a reply
  `{"ok": ..., "elapsed": s}` or `{"error": "<exception class>", "message": ..., "elapsed": s}` per line on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Self

import redis

from pipeline.cli.redis_bin import redis_binary
from tests.support.procs import ROOT, Command, ask, free_port, spawn_redis, stop_process, wait_for


class Node:
    """One redis-server on a free loopback port (no persistence), logging under `directory`."""

    def __init__(self, directory: Path, name: str, *extra: str) -> None:
        self.directory, self.name, self.extra = directory, name, extra
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> Node:
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        argv += ["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"]
        argv += ["--dbfilename", f"{self.name}.rdb", "--logfile", str(self.directory / f"{self.name}.log"), *self.extra]
        self.proc = spawn_redis(argv, self.client, f"redis-server {self.name} on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server cannot act on SIGTERM
        stop_process(self.proc)
        self.proc = None


class Replicated:
    """A primary and one replica of it, both stopped by PID (`stop`)."""

    def __init__(self, directory: Path, *primary_args: str) -> None:
        self.primary = Node(directory, "primary", *primary_args)
        self.replica = Node(directory, "replica")

    @property
    def url(self) -> str:
        return self.primary.url

    def start(self) -> Replicated:
        self.primary.start()
        self.replica.extra = ("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.start()
        wait_for(self.in_sync, 20, what="the replica to sync with the primary")
        return self

    def in_sync(self) -> bool:
        """The replica's link is up and it has confirmed everything the primary wrote (WAIT 1 answers 1 at once)."""
        if self.replica.client().info("replication").get("master_link_status") != "up":
            return False
        return int(self.primary.client().execute_command("WAIT", 1, 100)) == 1

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The replica stopped (SIGSTOP): connected, confirming nothing, until the block ends (SIGCONT)."""
        os.kill(self.replica.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.replica.pid, signal.SIGCONT)
        wait_for(self.in_sync, 20, what="the replica to catch up")

    def stop(self) -> None:
        self.replica.stop()
        self.primary.stop()


class CallFailed(Exception):
    """A producer call raised: `kind` is the exception's class name."""

    def __init__(self, kind: str, message: str, elapsed: float) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.elapsed = kind, message, elapsed


class ProducerProcess(Command):
    """`python -m tests.support.replicas` with settings of its own (`env` over the test's environment), answering
    calls over its stdin and stdout."""

    def __init__(self, log: Path, env: Mapping[str, str]) -> None:
        super().__init__([sys.executable, "-m", "tests.support.replicas"], log, env)

    def _popen(self, log: IO[bytes]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )

    def start(self) -> Self:
        super().start()
        self.call("ping")
        return self

    def timed(self, op: str, **args: Any) -> tuple[Any, float]:
        """The call's answer and how long it took in the producer; `CallFailed` if it raised."""
        assert self.proc is not None
        reply = ask(self.proc, op, args)
        if reply is None:
            raise RuntimeError(f"the producer process exited:\n{self.log()[-4000:]}")
        if "error" in reply:
            raise CallFailed(reply["error"], reply["message"], reply["elapsed"])
        return reply["ok"], reply["elapsed"]

    def call(self, op: str, **args: Any) -> Any:
        return self.timed(op, **args)[0]

    def stop(self, timeout: float = 10) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        super().stop(timeout)


def _serve() -> None:
    """Answer producer calls (see the module docstring) until stdin closes."""
    import logging

    from typer.testing import CliRunner

    from pipeline.cli.main import app
    from pipeline.dlq import admin
    from pipeline.dlq.envelope import DeadLetter, publish
    from pipeline.scheduling.delayed import release_due
    from pipeline.task import load_task_modules

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    tasks = load_task_modules()

    def cli(args: list[str]) -> dict[str, Any]:
        result = CliRunner().invoke(app, args)
        return {"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}

    ops: dict[str, Any] = {
        "ping": lambda: "pong",
        "queue": lambda kind: tasks[kind].queue,
        "enqueue": lambda kind, payload, key=None, countdown=None: tasks[kind].enqueue(
            payload, idempotency_key=key, countdown=countdown
        ),
        "enqueue_many": lambda kind, payloads: tasks[kind].enqueue_many(payloads),
        "dead_letter": lambda task, payload, queue: publish(
            DeadLetter(reason="failed", task_name=task, args=[payload], queue=queue, exception_type="ValueError")
        ),
        "replay": admin.replay,
        "release_due": lambda now: release_due(now=now),
        "cli": cli,
    }
    for line in sys.stdin:
        request = json.loads(line)
        op = ops[request.pop("op")]
        started = time.perf_counter()
        try:
            reply: dict[str, Any] = {"ok": op(**request)}
        except Exception as exc:  # noqa: BLE001  # every error goes back to the test, by class name
            reply = {"error": type(exc).__name__, "message": str(exc)}
        reply["elapsed"] = time.perf_counter() - started
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
