"""The stall watchdog: `pipeline worker-health` fails for a worker whose loop stopped or that stopped fetching.

Workers here run with STALL_TIMEOUT=3 on a queue of their own ("stall"), so the session worker never takes
their jobs; the probe is the real command, reading the heartbeat file the worker writes.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.observability.health import health_path
from tests.support.cli import run_cli
from tests.support.procs import RedisServer, wait_for, waiting
from tests.support.worker_app import attempts, ledger, ledger_client

pytestmark = pytest.mark.faults
QUEUE = "stall"
ENV = {"STALL_TIMEOUT": "3"}


@pytest.fixture
def node() -> Iterator[Any]:
    """Node names for this test's workers; their heartbeat files are removed after the workers stopped
    (tests request this fixture before `make_worker`, so it is torn down after it)."""
    names: list[str] = []

    def name(prefix: str) -> str:
        names.append(f"{prefix}@{socket.gethostname()}")
        return prefix

    yield name
    ledger_client().delete(QUEUE)
    for full in names:
        with contextlib.suppress(FileNotFoundError):
            health_path(get_settings().worker_health_dir, full).unlink()


def probe(name: str) -> subprocess.CompletedProcess[str]:
    return run_cli("worker-health", "--node", f"{name}@{socket.gethostname()}")


def probe_json(name: str) -> str:
    return run_cli("worker-health", "--node", f"{name}@{socket.gethostname()}", "--json").stdout


def healthy(name: str) -> bool:
    return probe(name).returncode == 0


def unhealthy_with(name: str, reason: str) -> str | None:
    result = probe(name)
    return result.stderr if result.returncode == 1 and reason in result.stderr else None


def send(n: int, key: str) -> list[str]:
    return [str(ledger.task.apply_async(({"key": f"{key}-{i}"},), queue=QUEUE).id) for i in range(n)]


def finish(ids: list[str]) -> None:
    for task_id in ids:
        assert ledger.result(task_id, timeout=20).key


def test_an_idle_worker_is_healthy(node: Any, make_worker: Any) -> None:
    name = node("stall-idle")
    result = probe(name)
    assert result.returncode == 1 and "no heartbeat file" in result.stderr
    make_worker(name, env=ENV, queues=QUEUE, concurrency=1)
    wait_for(lambda: healthy(name), 10, 0.2, what="a healthy heartbeat")
    finish(send(2, "idle"))  # it fetches and runs jobs, and stays healthy past the timeout
    wait_for(lambda: waiting(ledger_client(), QUEUE) == 0, 5, what="the queue to drain")
    result = probe(name)
    assert result.returncode == 0 and "healthy" in result.stdout, result


def test_a_frozen_worker_fails_with_a_stale_heartbeat_then_recovers(node: Any, make_worker: Any) -> None:
    name = node("stall-frozen")
    worker = make_worker(name, env=ENV, queues=QUEUE, concurrency=1)
    wait_for(lambda: healthy(name), 10, 0.2, what="a healthy heartbeat")
    worker.send_signal(signal.SIGSTOP)  # the main process: its event loop stops
    try:
        ids = send(3, "frozen")
        reason = wait_for(lambda: unhealthy_with(name, "heartbeat stale"), 12, 0.3, what="a stale heartbeat")
        assert "event loop is not running" in str(reason)
        # The BRPOP the worker issued before it froze takes one job; the others wait in the queue.
        assert waiting(ledger_client(), QUEUE) >= 2
    finally:
        worker.send_signal(signal.SIGCONT)
    wait_for(lambda: healthy(name), 10, 0.2, what="a fresh heartbeat after SIGCONT")
    finish(ids)


@pytest.mark.parametrize("pool", ["prefork", "threads"])  # the CPU and the I/O profiles
def test_a_worker_that_stops_consuming_while_jobs_wait_is_stalled(node: Any, make_worker: Any, pool: str) -> None:
    name = node(f"stall-cancel-{pool}")
    worker = make_worker(name, env=ENV, queues=QUEUE, concurrency=1, pool=pool)
    wait_for(lambda: healthy(name), 10, 0.2, what="a healthy heartbeat")
    control, destination = get_app().control, [f"{name}@{socket.gethostname()}"]
    assert control.cancel_consumer(QUEUE, destination=destination, reply=True, timeout=5)
    ids = send(3, "cancel")
    reason = wait_for(lambda: unhealthy_with(name, "queued jobs not fetched"), 12, 0.3, what="the stall verdict")
    assert f"3 in {QUEUE}" in str(reason)
    assert "worker stalled: queued jobs not fetched: 3 in stall" in worker.log()
    assert control.add_consumer(QUEUE, destination=destination, reply=True, timeout=5)
    finish(ids)
    wait_for(lambda: healthy(name), 10, 0.2, what="healthy again after add_consumer")
    wait_for(lambda: "worker consuming again" in worker.log(), 5, what="the recovery line")


def test_a_redis_outage_longer_than_the_timeout_restarts_no_worker(node: Any, make_worker: Any, work_dir: Path) -> None:
    """The consumer reconnects outside the event loop; the watchdog's reader keeps the heartbeat fresh meanwhile."""
    redis = RedisServer(work_dir / f"stall-redis-{uuid.uuid4().hex[:6]}").start()
    try:
        name = node("stall-outage")
        make_worker(name, env={**ENV, "REDIS_URL": redis.url}, queues=QUEUE, concurrency=1)
        wait_for(lambda: healthy(name), 10, 0.2, what="a healthy heartbeat")
        redis.stop()
        deadline = time.monotonic() + 3 * 3  # three times STALL_TIMEOUT
        while time.monotonic() < deadline:
            result = probe(name)
            assert result.returncode == 0, result.stderr
            time.sleep(0.5)
        assert "broker unreadable" in json.dumps(json.loads(probe_json(name))["heartbeat"])
        redis.start()
        wait_for(lambda: healthy(name) and "broker unreadable" not in probe_json(name), 30, 0.3, what="back to ok")
    finally:
        redis.stop()


def test_a_soft_shutdown_reports_stopping_not_a_stale_heartbeat(node: Any, make_worker: Any) -> None:
    """The soft shutdown blocks the event loop on purpose (in the signal handler): the probe stays healthy."""
    name, key = node("stall-stopping"), f"stopping-{uuid.uuid4().hex[:6]}"
    worker = make_worker(name, env={**ENV, "WORKER_SOFT_SHUTDOWN_TIMEOUT": "8"}, queues=QUEUE, concurrency=1)
    wait_for(lambda: healthy(name), 10, 0.2, what="a healthy heartbeat")
    ledger.task.apply_async(({"key": key, "sleep_s": 30, "sleep_once": True},), queue=QUEUE)
    wait_for(lambda: attempts(key), 15, 0.1, what="the job to start")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: '"stopping"' in probe_json(name), 5, 0.2, what="the stopping heartbeat")

    def heartbeat_older_than_the_timeout() -> bool:
        verdict = json.loads(probe_json(name))
        assert verdict["healthy"], verdict
        return bool(time.time() - verdict["heartbeat"]["at"] > 3.5)

    wait_for(heartbeat_older_than_the_timeout, 8, 0.3, what="a heartbeat older than STALL_TIMEOUT, still healthy")
    worker.wait(30)
    assert "no heartbeat file" in probe(name).stderr  # a worker that stopped removes its file
