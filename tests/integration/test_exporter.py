"""`pipeline exporter` over HTTP: depth summed over priority sub-queues, DLQ size, oldest job age, parked jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY
from pipeline.dlq.envelope import DeadLetter, publish
from pipeline.observability.exporter import QueueCollector
from tests.support.procs import RedisServer, free_port, wait_for
from tests.support.scrape import Samples, scrape, try_scrape, value
from tests.support.worker_app import ledger

pytestmark = pytest.mark.integration


@pytest.fixture
def no_parked_jobs(redis_server: RedisServer) -> Iterator[None]:
    """An empty `pipeline:delayed` (parked jobs other tests left behind would skew the count)."""
    client = redis_server.client()
    client.delete(DELAYED_KEY, DELAYED_MESSAGE_KEY, DELAYED_DEST_KEY)
    yield
    client.delete(DELAYED_KEY, DELAYED_MESSAGE_KEY, DELAYED_DEST_KEY)


@contextmanager
def running_exporter(work_dir: Path, *queues: str) -> Iterator[int]:
    """`pipeline exporter` for `queues` on a free port; yields the port, and checks it stopped cleanly."""
    port = free_port()
    exe = Path(sys.executable).parent / "pipeline"
    argv = [str(exe), "exporter", "--port", str(port), "--address", "127.0.0.1"]
    for queue in queues:
        argv += ["--queue", queue]
    with (work_dir / f"exporter-{port}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield port
        finally:
            proc.terminate()
            proc.wait(10)
    assert proc.returncode == 0


def test_exporter_reports_depth_dlq_and_age(spare_queue: str, clean_dlq: None, work_dir: Path) -> None:
    for _ in range(3):
        ledger.task.apply_async(({"key": "exporter"},), queue=spare_queue)
    for _ in range(2):
        ledger.task.apply_async(({"key": "exporter"},), queue=spare_queue, priority=9)
    for _ in range(2):
        publish(DeadLetter(reason="failed", task_name="test.ledger", exception_type="ValueError"))

    with running_exporter(work_dir, spare_queue, "default") as port:
        samples = wait_for(lambda: try_scrape(port), 20, 0.2, what="exporter /metrics")
        assert isinstance(samples, dict)
        assert value(samples, "pipeline_queue_depth", queue=spare_queue) == 5
        assert value(samples, "pipeline_dlq_size") == 2
        assert value(samples, "pipeline_broker_up") == 1
        in_flight = value(samples, "pipeline_queue_in_flight")
        assert in_flight is not None
        assert in_flight >= 0
        age = value(samples, "pipeline_queue_oldest_age_seconds", queue=spare_queue)
        assert age is not None
        assert age > 0
        assert value(samples, "pipeline_queue_depth", queue="dead_letter") is None, "the DLQ is its own figure"
        # Figures are read at scrape time: a job more shows at once.
        ledger.task.apply_async(({"key": "exporter"},), queue=spare_queue, priority=6)
        assert value(scrape(port), "pipeline_queue_depth", queue=spare_queue) == 6


def test_exporter_reports_parked_delayed_jobs(no_parked_jobs: None, work_dir: Path) -> None:
    ledger.enqueue({"key": "exporter-parked"}, countdown=3600)
    ledger.enqueue({"key": "exporter-parked"}, countdown=7200)

    with running_exporter(work_dir, "default") as port:
        samples = wait_for(lambda: try_scrape(port), 20, 0.2, what="exporter /metrics")
        assert isinstance(samples, dict)
        assert value(samples, "pipeline_delayed_jobs") == 2
        assert value(samples, "pipeline_delayed_overdue_seconds") == 0  # none is due yet
        # Parked jobs are not waiting on their queue: they are their own figure, read at each scrape.
        ledger.enqueue({"key": "exporter-parked"}, countdown=10 * 86400)
        assert value(scrape(port), "pipeline_delayed_jobs") == 3


def _collected(collector: QueueCollector) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value for family in collector.collect() for s in family.samples}


def test_overdue_is_measured_from_the_earliest_parked_job(no_parked_jobs: None) -> None:
    ledger.enqueue({"key": "exporter-overdue"}, countdown=3600)
    ledger.enqueue({"key": "exporter-overdue"}, countdown=7200)
    a_day_later = time.time() + 86400  # as if no worker or beat had released anything for a day

    samples = _collected(QueueCollector(("default",), clock=lambda: a_day_later))
    assert value(samples, "pipeline_delayed_jobs") == 2
    overdue = value(samples, "pipeline_delayed_overdue_seconds")
    assert overdue is not None
    assert 86400 - 3600 <= overdue <= 86400 - 3600 + 5  # plus the seconds between enqueue and collect
    assert value(_collected(QueueCollector(("default",))), "pipeline_delayed_overdue_seconds") == 0
