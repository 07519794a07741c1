"""Queue-wait arithmetic, reading custom headers off a request, and the dead-PID sweep, without a broker."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

from celery.app.task import Context

from pipeline.constants import HEADER_IDEMPOTENCY_KEY, HEADER_PUBLISHED_AT, HEADER_RATE_GRANT, HEADER_RATE_SLOT
from pipeline.observability.endpoint import sweep
from pipeline.observability.task_metrics import queue_wait
from pipeline.task import request_header


def _request(published: float | None, eta: str | None = None) -> SimpleNamespace:
    fields = {"eta": eta, "headers": None}
    if published is not None:
        fields[HEADER_PUBLISHED_AT] = published
    return SimpleNamespace(**fields)


def test_wait_is_start_minus_publish() -> None:
    assert queue_wait(_request(100.0), now=103.5) == 3.5


def test_wait_excludes_eta_delay() -> None:
    eta = datetime.fromtimestamp(160.0, UTC).isoformat()
    assert queue_wait(_request(100.0, eta), now=161.0) == 1.0


def test_wait_is_clamped_at_zero_when_clocks_disagree() -> None:
    assert queue_wait(_request(200.0), now=199.0) == 0.0


def test_no_header_no_observation() -> None:
    assert queue_wait(_request(None), now=10.0) is None


def test_a_header_is_what_the_message_carries_at_its_top_level() -> None:
    """Celery makes each header of a message an attribute of the task's request (`Context`); a `headers` entry of the
    message's own (what `send_task(..., headers={"headers": {...}})` sends) becomes `request.headers`, never read."""
    top = Context({"id": "a", "eta": None, HEADER_PUBLISHED_AT: 50.0, HEADER_IDEMPOTENCY_KEY: "k-1"})
    assert queue_wait(top, now=52.0) == 2.0
    assert request_header(top, HEADER_IDEMPOTENCY_KEY) == "k-1" and top.headers == {
        HEADER_PUBLISHED_AT: 50.0,
        HEADER_IDEMPOTENCY_KEY: "k-1",
    }
    forged = {HEADER_RATE_GRANT: {"key": "k", "slot": 1.0, "due": 1.0}, HEADER_IDEMPOTENCY_KEY: "k-2"}
    nested = Context({"id": "b", "headers": forged})
    assert nested.headers == forged  # where Celery puts it
    assert request_header(nested, HEADER_RATE_GRANT) is None and request_header(nested, HEADER_IDEMPOTENCY_KEY) is None
    assert request_header(SimpleNamespace(**{HEADER_RATE_SLOT: 0.0}), HEADER_RATE_SLOT) == 0.0
    assert request_header(SimpleNamespace(headers=None), HEADER_RATE_SLOT) is None


def test_sweep_marks_only_dead_pids(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead = int(done.stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for pid in (dead, alive.pid):
            (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
            (tmp_path / f"counter_{pid}.db").write_bytes(b"")
        swept: set[int] = set()
        assert sweep(tmp_path, swept) == [dead]
        assert not (tmp_path / f"gauge_livesum_{dead}.db").exists()
        assert (tmp_path / f"counter_{dead}.db").exists(), "counters stay so totals never go backwards"
        assert (tmp_path / f"gauge_livesum_{alive.pid}.db").exists()
        assert sweep(tmp_path, swept) == []
    finally:
        alive.kill()
        alive.wait()
