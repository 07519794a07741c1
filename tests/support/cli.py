"""The `pipeline` command run in the test process (typer's CliRunner), with what a subprocess would report, or in a
process of its own (`python -m pipeline`) where its environment is under test.

Settings and the Celery app are the test process's (the same environment a subprocess would read), so a
command costs no interpreter start. A command that crashes re-raises here instead of becoming exit code 1.
"""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`pipeline ARGS`: its exit code, stdout and stderr."""
    from typer.testing import CliRunner

    from pipeline.cli.main import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["pipeline", *args], result.exit_code, result.stdout, result.stderr)


def run_pipeline(*args: str, env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline ARGS` in a process of its own with exactly `env`: its exit code, stdout and stderr."""
    argv = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
