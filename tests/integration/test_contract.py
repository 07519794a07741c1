"""The typed task contract end to end: real Redis, a real prefork worker, results through the backend."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from celery import signals

from pipeline.celery_app import get_app
from pipeline.errors import PayloadInvalid
from tasks.probe import ProbeResult, probe
from tests.support.dlq import dead_letter
from tests.support.worker_app import attempts, ledger

pytestmark = pytest.mark.integration


def test_task_succeeds_and_its_typed_result_comes_back(session_worker: Any) -> None:
    task_id = probe.enqueue({"message": "hello"})
    result = probe.result(task_id, timeout=30)
    assert isinstance(result, ProbeResult)
    assert result.message == "hello" and result.attempt == 1


def test_foreign_client_calls_by_name_with_one_json_object(session_worker: Any) -> None:
    raw = get_app().send_task("pipeline.probe", args=[{"message": "from elsewhere"}]).get(timeout=30)
    assert isinstance(raw, dict) and raw["message"] == "from elsewhere"


def test_invalid_payload_is_refused_at_enqueue_and_nothing_is_published() -> None:
    published: list[Any] = []

    def spy(**kwargs: Any) -> None:
        published.append(kwargs)

    signals.before_task_publish.connect(spy, weak=False)
    try:
        with pytest.raises(PayloadInvalid) as err:
            probe.enqueue({"message": "x", "fail": "sometimes", "sleep_s": -1})
    finally:
        signals.before_task_publish.disconnect(spy)
    assert published == []
    fields = {tuple(e["loc"]) for e in err.value.errors}
    assert fields == {("fail",), ("sleep_s",)}
    assert "fail:" in str(err.value) and "sleep_s:" in str(err.value)


def test_invalid_payload_from_a_foreign_client_is_dead_lettered_without_retries(
    session_worker: Any, clean_dlq: None
) -> None:
    key = "foreign-invalid"
    task_id = get_app().send_task("test.ledger", args=[{"key": key, "fail": "explode"}]).id
    entry = dead_letter(task_id)
    assert entry.exception_type == "pipeline.errors.PayloadInvalid"
    assert "fail: Input should be" in entry.exception_message
    assert entry.attempts == 1 and entry.queue == "default"
    assert entry.payload == {"key": key, "fail": "explode"}
    assert attempts(key) == []  # the task body never ran


def test_more_than_one_argument_is_refused_by_the_worker(session_worker: Any, clean_dlq: None) -> None:
    task_id = get_app().send_task("pipeline.probe", args=[{"message": "a"}, {"message": "b"}]).id
    entry = dead_letter(task_id)
    assert "exactly one positional argument" in entry.exception_message


def test_transient_failures_retry_with_doubling_gaps_then_succeed(session_worker: Any) -> None:
    key = "transient-3"
    task_id = ledger.enqueue({"key": key, "fail": "transient", "fail_times": 3})
    assert ledger.result(task_id, timeout=60).attempt == 4
    times = [a["t"] for a in attempts(key)]
    assert [a["attempt"] for a in attempts(key)] == [1, 2, 3, 4]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # base 0.3 s (tests' RETRY_BASE_DELAY) with ±5 % jitter: 0.3, 0.6, 1.2 plus scheduling latency
    assert 0.25 <= gaps[0] <= 1.0, gaps
    for earlier, later in itertools.pairwise(gaps):
        assert 1.5 <= later / earlier <= 2.7, gaps


def test_permanent_failure_is_tried_once_then_dead_lettered_with_traceback(
    session_worker: Any, clean_dlq: None
) -> None:
    key = "permanent-1"
    task_id = ledger.enqueue({"key": key, "fail": "permanent"})
    entry = dead_letter(task_id)
    assert len(attempts(key)) == 1
    assert entry.reason == "failed" and entry.attempts == 1
    assert entry.exception_type == "pipeline.errors.PermanentError"
    assert entry.exception_message == "permanent failure"
    assert entry.traceback and 'raise PermanentError("permanent failure")' in entry.traceback
    assert entry.task_name == "test.ledger" and entry.payload["key"] == key
    assert entry.worker.startswith("session@")


def test_exhausted_retries_make_exactly_five_attempts_then_a_dlq_entry(session_worker: Any, clean_dlq: None) -> None:
    key = "always-transient"
    task_id = ledger.enqueue({"key": key, "fail": "transient"})
    entry = dead_letter(task_id, timeout=60)
    assert [a["attempt"] for a in attempts(key)] == [1, 2, 3, 4, 5]
    assert entry.attempts == 5
    assert entry.exception_type == "pipeline.errors.TransientError"
    assert "attempt 5" in entry.exception_message


def test_enqueue_with_the_same_idempotency_key_returns_the_same_job(session_worker: Any) -> None:
    first = probe.enqueue({"message": "once"}, idempotency_key="order-42")
    second = probe.enqueue({"message": "once"}, idempotency_key="order-42")
    assert first == second
    assert probe.result(first, timeout=30).message == "once"


def test_job_status_reports_result_and_dead_letter(session_worker: Any, clean_dlq: None) -> None:
    from pipeline.status import JobState, job_status

    ok = probe.enqueue({"message": "s"})
    probe.result(ok, timeout=30)
    succeeded = job_status(ok)
    assert succeeded.state == JobState.SUCCEEDED and succeeded.final
    bad = probe.enqueue({"fail": "permanent"})
    entry = dead_letter(bad)
    status = job_status(bad)
    assert status.state == JobState.DEAD_LETTERED and status.final and status.dlq_id == entry.id
    assert status.error is not None and status.error.type == "PermanentError"
    assert json.loads(status.model_dump_json())["state"] == "dead_lettered"  # JSON-safe for the CLI and the API


def test_celery_inspect_ping_reaches_the_worker(session_worker: Any) -> None:
    import socket
    import subprocess
    import sys

    node = f"{session_worker.name}@{socket.gethostname()}"
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "pipeline", "inspect", "ping", "-d", node, "--timeout", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pong" in proc.stdout
