"""A worker started on a kombu it was not verified on refuses to start, naming it, unless the risk is accepted.

The version guard reads the installed versions from the distributions' metadata (`importlib.metadata`), so a
`kombu-5.8.0.dist-info` ahead of site-packages on PYTHONPATH makes the real kombu report 5.8.0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import ROOT, RedisServer, Worker, wait_for

pytestmark = pytest.mark.integration


def _fake_kombu(directory: Path, version: str) -> dict[str, str]:
    info = directory / f"kombu-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kombu\nVersion: {version}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH", "")]))}


def test_a_worker_on_an_unverified_kombu_refuses_to_start_naming_it(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {**os.environ, **_fake_kombu(tmp_path / "site", "5.8.0"), "REDIS_URL": redis_server.url}
    env.pop("ALLOW_UNVERIFIED_VERSIONS", None)
    argv = [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "worker", "-P", "solo", "-l", "INFO"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kombu 5.8.0" in done.stderr and "refusing to start the worker" in done.stderr
    assert "make upgrade-check" in done.stderr and "ALLOW_UNVERIFIED_VERSIONS" in done.stderr
    assert "Traceback" not in done.stderr
    assert " ready." not in done.stdout + done.stderr


def test_a_worker_that_accepts_the_risk_starts_and_says_so(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {**_fake_kombu(tmp_path / "site", "5.8.0"), "ALLOW_UNVERIFIED_VERSIONS": "true"}
    worker = Worker("unverified", tmp_path / "logs", env, pool="solo", concurrency=1, queues="unverified-q")
    try:
        worker.start()
        assert "runs on unverified versions" in worker.log() and "kombu 5.8.0" in worker.log()
    finally:
        worker.stop()


def test_a_worker_answers_stats_and_conf_with_its_transport_named_by_path(make_worker: Any) -> None:
    """Flower and `celery inspect` ask every worker for `stats` and `conf`: the replies are JSON, so the worker's
    transport, bound to its leases, is named by a class path, never held as a class (which made each reply fail)."""
    from pipeline.celery_app import get_app

    worker = make_worker("inspected", queues=f"inspected-{uuid.uuid4().hex[:6]}", concurrency=1, pool="solo")
    node = f"inspected@{socket.gethostname()}"
    # Listening first: a worker on a loaded machine may answer its first broadcast later than an inspect's timeout.
    wait_for(lambda: get_app().control.ping(destination=[node], timeout=1), 60, 0, what=f"{node} to answer a ping")
    inspect = get_app().control.inspect(destination=[node], timeout=5)
    stats, conf = inspect.stats(), inspect.conf()
    assert stats and conf, worker.log()[-2000:]
    transport = conf[node]["broker_transport"]
    assert isinstance(transport, str) and transport.startswith("pipeline.delivery.transport:Transport_")
    assert stats[node]["broker"]["transport"] == transport
    assert "Control command error" not in worker.log()
