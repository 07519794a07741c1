"""`pipeline exporter` over HTTP: depth summed over priority sub-queues, DLQ size, oldest job age."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.dlq.envelope import DeadLetter, publish
from tests.support.procs import RedisServer, free_port, wait_for
from tests.support.scrape import scrape, try_scrape, value
from tests.support.worker_app import ledger

pytestmark = pytest.mark.integration


@pytest.fixture
def fill_queue(redis_server: RedisServer) -> Iterator[str]:
    queue = f"obs-fill-{uuid.uuid4().hex[:8]}"
    yield queue
    from pipeline.broker import queue_keys

    redis_server.client().delete(*queue_keys(queue))


def test_exporter_reports_depth_dlq_and_age(fill_queue: str, clean_dlq: None, work_dir: Path) -> None:
    for _ in range(3):
        ledger.task.apply_async(({"key": "exporter"},), queue=fill_queue)
    for _ in range(2):
        ledger.task.apply_async(({"key": "exporter"},), queue=fill_queue, priority=9)
    for _ in range(2):
        publish(DeadLetter(reason="failed", task_name="test.ledger", exception_type="ValueError"))

    port = free_port()
    exe = Path(sys.executable).parent / "pipeline"
    log = (work_dir / "exporter.log").open("wb")
    proc = subprocess.Popen(
        [str(exe), "exporter", "--port", str(port), "--address", "127.0.0.1", "--queue", fill_queue, "-q", "default"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        samples = wait_for(lambda: try_scrape(port), 20, 0.2, what="exporter /metrics")
        assert isinstance(samples, dict)
        assert value(samples, "pipeline_queue_depth", queue=fill_queue) == 5
        assert value(samples, "pipeline_dlq_size") == 2
        assert value(samples, "pipeline_broker_up") == 1
        in_flight = value(samples, "pipeline_queue_in_flight")
        assert in_flight is not None
        assert in_flight >= 0
        age = value(samples, "pipeline_queue_oldest_age_seconds", queue=fill_queue)
        assert age is not None
        assert age > 0
        assert value(samples, "pipeline_queue_depth", queue="dead_letter") is None, "the DLQ is its own figure"
        # Figures are read at scrape time: a job more shows at once.
        ledger.task.apply_async(({"key": "exporter"},), queue=fill_queue, priority=6)
        assert value(scrape(port), "pipeline_queue_depth", queue=fill_queue) == 6
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    assert proc.returncode == 0
