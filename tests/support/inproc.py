"""A real Celery worker inside the test process: Celery's embedded test worker in a thread, on the real Redis.

It runs the app `celery -A tests.support.worker_app` runs (the pipeline app, the worker runtime installed,
the test-only tasks registered) and consumes the session Redis like any worker, without a cold interpreter
start or a process to stop. The pool is `solo`: one job at a time, in the worker's thread. What only a
prefork worker does (pool children killed or timed out, revoke with terminate, time limits, a pid of its
own) is tested on subprocess workers (`tests.support.procs.Worker`).

Its log goes to a file, as a subprocess worker's does (`log()`); the test process's logging is restored
when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class InProcessWorker:
    """`start()` runs it until `stop()`; `name`, `hostname`, `log()` and `pid` as for a subprocess worker."""

    def __init__(self, name: str, log_dir: Path, queues: list[str]) -> None:
        self.name = name
        self.hostname = f"{name}@{socket.gethostname()}"
        self.log_path = log_dir / f"worker-{name}.log"
        self.queues = queues
        self._stack = contextlib.ExitStack()
        self.controller: Any = None

    def start(self) -> InProcessWorker:
        from celery.app import trace
        from celery.contrib.testing.worker import start_worker

        from pipeline import runtime
        from tests.support.inproc_controller import Controller
        from tests.support.worker_app import app  # the test tasks register themselves with the app

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        runtime.install()
        self._stack.callback(runtime.uninstall)
        self._stack.enter_context(_logging_restored())
        # What `celery worker` does before it consumes (`celery.apps.worker`): among others, jobs see the
        # node name as their request's hostname.
        trace.setup_worker_optimizations(app, self.hostname)
        self._stack.callback(trace.reset_worker_optimizations, app)
        self.controller = self._stack.enter_context(
            start_worker(
                app,
                pool="solo",
                concurrency=1,
                loglevel="INFO",
                logfile=str(self.log_path),
                perform_ping_check=False,
                shutdown_timeout=30,
                hostname=self.hostname,
                queues=self.queues,
                WorkController=Controller,
            )
        )
        return self

    def stop(self) -> None:
        self._stack.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        return os.getpid()


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """The worker's logging setup replaces the root logger's handlers: put the test process's back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
