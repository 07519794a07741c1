"""A plain `pip install` of the package, unlocked, into a fresh virtualenv yields a worker that starts and runs a job.

pip resolves every requirement within pyproject.toml's ranges from the index, as a user's install does: the newest
releases of the day, not the lock. A release inside a range that the version guard refuses, or a requirement the
package uses but does not declare, fails here. The tree is copied first (pip builds in the source directory: the
checkout stays clean); pip's cache is used as it is, warm on a developer's machine and on CI's (31 s on a quiet
machine, most of it resolution). `make test-install` runs it, a step of its own in .ci/run (it needs the index).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.install

#: What a copy of the tree leaves out: virtualenvs, local data, caches and build output.
NOT_SOURCE = (".git", ".venv", ".data", ".upgrade-check", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
#: The fresh virtualenv's Python: this interpreter's base installation, not the project virtualenv.
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
GUARDED_VERSIONS = (
    "from pipeline.compat import versions; import json;"
    " print(json.dumps({'installed': {n: versions.installed(n) for n in versions.GUARDED},"
    " 'verified': versions.verified(), 'mismatches': [str(m) for m in versions.mismatches(versions.GUARDED)]}))"
)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without the project virtualenv's traces (PYTHONPATH, VIRTUAL_ENV)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    return {**env, **extra}


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout, check=False)


def test_a_plain_pip_install_starts_a_worker_that_runs_a_job(tmp_path: Path) -> None:
    source, venv, elsewhere = tmp_path / "source", tmp_path / "venv", tmp_path / "cwd"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    elsewhere.mkdir()  # not the source tree: `pipeline` is imported from the virtualenv
    made = _run([str(BASE_PYTHON), "-m", "venv", str(venv)], elsewhere, 120)
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", "--quiet", "--no-compile", str(source)], elsewhere, 900)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    guarded = _run([python, "-c", GUARDED_VERSIONS], elsewhere, 60)
    assert guarded.returncode == 0, guarded.stderr
    report = json.loads(guarded.stdout)
    print(f"resolved: {report['installed']}; verified: {report['verified']}")
    assert report["mismatches"] == []  # every version pip chose is one the guard accepts

    redis_server = RedisServer(tmp_path / "redis").start()
    log_path = tmp_path / "worker.log"
    argv = [str(venv / "bin" / "celery"), "-A", "pipeline", "worker", "-c", "1", "-l", "INFO", "--without-mingle"]
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            argv,
            cwd=elsewhere,
            env=_clean_env(REDIS_URL=redis_server.url),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: " ready." in log_path.read_text() or worker.poll() is not None, 60, 0.1, what="the worker")
        assert worker.poll() is None, log_path.read_text()[-3000:]
        enqueue = [str(venv / "bin" / "pipeline"), "enqueue", "probe", '{"message": "plain install"}', "--wait"]
        done = subprocess.run(
            [*enqueue, "--timeout", "60", "--json"],
            cwd=elsewhere,
            env=_clean_env(REDIS_URL=redis_server.url),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr + log_path.read_text()[-3000:]
        assert "plain install" in done.stdout
    finally:
        _stop(worker)
        redis_server.stop()


def _stop(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's process group (its pool children with it), SIGKILL it after 30 s."""
    with contextlib.suppress(ProcessLookupError):  # it exited at start: nothing left to stop
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
