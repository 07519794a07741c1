"""A solo worker starts a plain job with Celery's own calls in a row (`pipeline.compat.strategy`): the job is
received, reserved, run, stored and accounted for as through Celery's pool (the parity test runs one job each way and
compares), and what the direct path does not take (a countdown, a revoked id) still goes Celery's way.

The embedded session worker is a solo worker in this process: its signals and its state are read here directly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from celery.result import AsyncResult
from celery.worker import state as worker_state

from pipeline import compat
from pipeline.celery_app import get_app
from pipeline.compat import strategy
from tests.support.compat import verified_as_installed
from tests.support.procs import wait_for
from tests.support.worker_app import attempts, ledger

pytestmark = pytest.mark.integration


@pytest.fixture
def direct_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task ids the direct path hands to the tracer."""
    calls: list[str] = []
    real = strategy.apply_target

    def spy(target: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        calls.append(str(args[1]))
        return real(target, args, *rest, **kwargs)

    monkeypatch.setattr(strategy, "apply_target", spy)
    return calls


@pytest.fixture
def lifecycle() -> Iterator[list[tuple[str, str]]]:
    """(signal, task id) for every task_received, task_prerun and task_postrun of this process, in order."""
    seen: list[tuple[str, str]] = []

    def received(request: Any = None, **_: Any) -> None:
        seen.append(("received", str(request.id)))

    def prerun(task_id: str = "", **_: Any) -> None:
        seen.append(("prerun", task_id))

    def postrun(task_id: str = "", state: str = "", **_: Any) -> None:
        seen.append((f"postrun {state}", task_id))

    hooks = [(signals.task_received, received), (signals.task_prerun, prerun), (signals.task_postrun, postrun)]
    for signal, hook in hooks:
        signal.connect(hook, weak=False)
    yield seen
    for signal, hook in hooks:
        signal.disconnect(hook)


@pytest.fixture
def direct_path(session_worker: Any) -> Iterator[None]:
    """The direct path on in the session worker, whatever the installed Celery: the parity tier also runs on versions
    not verified yet (`make upgrade-check`), where the worker started with Celery's own strategy."""
    if compat.enabled(strategy.__name__):
        yield
        return
    consumer = session_worker.controller.consumer
    with verified_as_installed():
        consumer.update_strategies()  # what the worker does when it starts consuming: each task's strategy, again
    yield
    consumer.update_strategies()


def _run(session_worker: Any, lifecycle: list[tuple[str, str]]) -> tuple[str, tuple[Any, ...]]:
    """Run one plain job; its id and what the worker did with it."""
    before = worker_state.total_count.get(ledger.name, 0)
    key = uuid.uuid4().hex
    task_id = ledger.enqueue({"key": key})
    attempt = ledger.result(task_id, timeout=30).attempt
    wait_for(lambda: task_id not in {r.id for r in worker_state.active_requests}, 10, 0.05, what="the job to be done")
    log = session_worker.log()
    return task_id, (
        [name for name, tid in lifecycle if tid == task_id],
        attempt,
        len(attempts(key)),
        worker_state.total_count[ledger.name] - before,
        task_id in {r.id for r in worker_state.reserved_requests},
        AsyncResult(task_id, app=get_app()).state,
        f"[{task_id}] received" in log,
        f"[{task_id}] succeeded" in log,
    )


@pytest.mark.parity
def test_the_direct_path_runs_a_job_as_celerys_handler_does(
    session_worker: Any,
    direct_path: None,
    direct_calls: list[str],
    lifecycle: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One plain job on the direct path, one through Celery's own handler (which the direct path hands every message
    to while the pool logs each job it applies): the same signals in the same order, one run, counted once, no longer
    reserved, stored, and the same log lines."""
    direct_id, direct = _run(session_worker, lifecycle)
    monkeypatch.setattr(session_worker.controller.consumer.pool, "_does_debug", True, raising=False)
    celery_id, celerys = _run(session_worker, lifecycle)
    assert (direct_calls.count(direct_id), direct_calls.count(celery_id)) == (1, 0)
    assert direct == celerys
    assert direct == (["received", "prerun", "postrun SUCCESS"], 1, 1, 1, False, "SUCCESS", True, True)


def test_a_plain_job_takes_the_direct_path_and_is_received_run_stored_and_counted(
    session_worker: Any, direct_calls: list[str], lifecycle: list[tuple[str, str]]
) -> None:
    before = worker_state.total_count.get(ledger.name, 0)
    key = uuid.uuid4().hex
    task_id = ledger.enqueue({"key": key})
    assert ledger.result(task_id, timeout=30).attempt == 1
    wait_for(lambda: task_id not in {r.id for r in worker_state.active_requests}, 10, 0.05, what="the job to be done")

    assert direct_calls.count(task_id) == 1
    assert [name for name, tid in lifecycle if tid == task_id] == ["received", "prerun", "postrun SUCCESS"]
    assert len(attempts(key)) == 1  # ran once
    assert worker_state.total_count[ledger.name] == before + 1  # task_ready counted it, as the pool's callback does
    assert task_id not in {r.id for r in worker_state.reserved_requests}
    assert AsyncResult(task_id, app=get_app()).state == "SUCCESS"
    log = session_worker.log()
    assert f"[{task_id}] received" in log and f"[{task_id}] succeeded" in log


def test_a_job_with_a_countdown_goes_celerys_way_and_runs_once(
    session_worker: Any, direct_calls: list[str], lifecycle: list[tuple[str, str]]
) -> None:
    key = uuid.uuid4().hex
    task_id = ledger.enqueue({"key": key}, countdown=0.5)
    started = time.time()
    assert ledger.result(task_id, timeout=30).attempt == 1
    assert time.time() - started >= 0.4
    wait_for(lambda: task_id not in {r.id for r in worker_state.active_requests}, 10, 0.05, what="the job to be done")
    assert task_id not in direct_calls  # Celery's strategy held it for its ETA, then its pool ran it
    assert [name for name, tid in lifecycle if tid == task_id] == ["received", "prerun", "postrun SUCCESS"]
    assert len(attempts(key)) == 1


def test_a_revoked_id_is_not_run_on_the_direct_path(session_worker: Any, direct_calls: list[str]) -> None:
    app = get_app()
    task_id = str(uuid.uuid4())
    app.control.revoke(task_id, destination=[session_worker.hostname], reply=True, timeout=5)
    wait_for(lambda: task_id in worker_state.revoked, 10, 0.05, what="the worker to know the revoke")
    key = uuid.uuid4().hex
    ledger.task.apply_async(({"key": key},), task_id=task_id)
    wait_for(lambda: AsyncResult(task_id, app=app).state == "REVOKED", 30, 0.1, what="the REVOKED state")
    assert attempts(key) == []
    assert task_id not in direct_calls
