"""A real `celery beat` process for tests (celery-redbeat scheduler), logging to a file, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support.procs import ROOT


class Beat:
    def __init__(self, name: str, log_dir: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"beat-{name}.log"
        self.env = {**os.environ, **env}
        self.argv = [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "beat", "-l", "INFO"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Beat:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

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

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None
