"""A real `celery beat` process for tests (celery-redbeat scheduler), logging to a file, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support.procs import Command


class Beat(Command):
    def __init__(self, name: str, log_dir: Path, env: Mapping[str, str]) -> None:
        argv = [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "beat", "-l", "INFO"]
        super().__init__(argv, log_dir / f"beat-{name}.log", env)
        self.name = name

    def sent(self, entry: str) -> int:
        """How many times this beat sent `entry`."""
        return self.log().count(f"Sending due task {entry} ")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the beat dies without releasing its lock, as in a crashed node."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10) -> None:
        super().stop(timeout)
