"""The lean worker, on real workers: task events only while something asks for them, STARTED stored only by
tasks that track it (status still says "started" for them), prefetch by profile, and the I/O profile
(`pipeline worker --processes`: asyncio-pool workers under a supervisor) dead-lettering, counting, rate-limiting and
enforcing time limits; with `--pool solo`, results carried by the acknowledging call and a shutdown that requeues.

Each test uses queues of its own, so the session worker never takes their jobs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import records
from pipeline.celery_app import get_app
from pipeline.status import JobState, job_status
from pipeline.task import load_task_modules
from tests.support.dlq import dead_letter
from tests.support.limited import limited, starts
from tests.support.procs import RedisServer, Worker, free_port, wait_for, waiting
from tests.support.scrape import scrape, value
from tests.support.tracked import tracked, untracked
from tests.support.worker_app import attempts, awaiting, ledger, ledger_client

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def events_seen() -> Iterator[list[dict[str, Any]]]:
    """Every Celery event published while the block runs (a receiver like Flower's, in a thread)."""
    app = get_app()
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def capture() -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": seen.append})
            while not stop.is_set():
                with contextlib.suppress(TimeoutError, socket.timeout):
                    receiver.capture(limit=None, timeout=0.5, wakeup=False)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(10)


def heartbeat_after(seen: list[dict[str, Any]], hostname: str, t: float) -> bool:
    """A heartbeat of `hostname` sent after `t` was received: its earlier events were too (one publisher)."""
    return any(e["type"] == "worker-heartbeat" and e["hostname"] == hostname and e["timestamp"] > t for e in seen)


def task_events(seen: list[dict[str, Any]], task_id: str) -> list[str]:
    return [e["type"] for e in seen if e.get("uuid") == task_id]


def run_job(queue: str) -> tuple[str, float]:
    result = ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue)
    result.get(timeout=30)
    return str(result.id), time.time()


def quiet_then_loud(seen: list[dict[str, Any]], hostname: str, queue: str) -> str:
    """A job with task events off (none seen before the worker's next heartbeat), then, after what Flower sends
    every 5 s, a job whose task events arrive; returns that job's id."""
    wait_for(lambda: heartbeat_after(seen, hostname, 0), 30, 0.1, what="the receiver to hear the worker")
    quiet, done_at = run_job(queue)
    wait_for(lambda: heartbeat_after(seen, hostname, done_at), 30, 0.1, what="a heartbeat after the job")
    assert task_events(seen, quiet) == []
    get_app().control.enable_events(destination=[hostname])
    loud, _ = run_job(queue)
    wait_for(lambda: "task-succeeded" in task_events(seen, loud), 30, 0.1, what="task events once asked")
    return loud


def test_task_events_are_off_until_asked_for_and_stop_when_nobody_asks(make_worker: Any) -> None:
    queue = f"events-{uuid.uuid4().hex[:6]}"
    worker = make_worker("events", {"EVENTS_IDLE_TIMEOUT": "10"}, queues=queue, concurrency=1)
    hostname = f"events@{socket.gethostname()}"
    with events_seen() as seen:
        # Off by default; on at what Flower sends every 5 s.
        loud = quiet_then_loud(seen, hostname, queue)
        assert task_events(seen, loud)[:2] == ["task-received", "task-started"]

        # Nobody asks again: after EVENTS_IDLE_TIMEOUT the worker stops sending them.
        def silent_job() -> bool:
            job, at = run_job(queue)
            wait_for(lambda: heartbeat_after(seen, hostname, at), 30, 0.1, what="a heartbeat after the job")
            return task_events(seen, job) == []

        wait_for(silent_job, 60, 1, what="task events to stop without requests")
    wait_for(lambda: "task events off: nobody asked for them" in worker.log(), 30, 0.2, what="the worker to say so")


def test_a_solo_worker_sends_task_events_once_asked(make_worker: Any) -> None:
    """A solo worker starts plain jobs on its direct path (`pipeline.compat.strategy`): no task event while they
    are off, Celery's three once Flower asks, with the fields Flower reads."""
    queue = f"events-solo-{uuid.uuid4().hex[:6]}"
    make_worker("events-solo", queues=queue, concurrency=1, pool="solo")
    hostname = f"events-solo@{socket.gethostname()}"
    with events_seen() as seen:
        loud = quiet_then_loud(seen, hostname, queue)
        assert task_events(seen, loud) == ["task-received", "task-started", "task-succeeded"]
        received = next(e for e in seen if e.get("uuid") == loud and e["type"] == "task-received")
        assert received["name"] == ledger.name and "key" in received["args"] and received["retries"] == 0


def test_a_worker_says_the_old_visibility_timeout_setting_is_no_longer_read(make_worker: Any) -> None:
    worker = make_worker("oldvt", {"VISIBILITY_TIMEOUT": "3600"}, queues=f"oldvt-{uuid.uuid4().hex[:6]}")
    wait_for(lambda: " ready." in worker.log(), 60, 0.2, what="the worker to start")
    assert "VISIBILITY_TIMEOUT=3600 is no longer read" in worker.log()
    assert "LEASE_SECONDS=30" in worker.log()


def _accept(task: Any, queue: str) -> str:
    """Record and publish a held job on `queue`, as `enqueue` does for a routed task."""
    task_id = str(uuid.uuid4())
    records.record_accepted(task_id, task.name, None, queue)
    task.task.apply_async(({"key": task_id},), queue=queue, task_id=task_id)
    return task_id


def test_only_tracking_tasks_store_started_and_status_follows(make_worker: Any) -> None:
    declared = {name: get_app().tasks[t.name].track_started for name, t in load_task_modules().items()}
    assert declared["pdf"] is declared["transcode"] is True
    assert declared["email"] is declared["webhook"] is declared["probe"] is False

    queue = f"tracked-{uuid.uuid4().hex[:6]}"
    worker = make_worker("tracked", {"WORKER_PROFILE": "long"}, queues=queue, concurrency=2)
    assert "worker profile long: prefetch 1 per process" in worker.log()
    held = {"tracked": _accept(tracked, queue), "untracked": _accept(untracked, queue)}
    for task_id in held.values():
        wait_for(lambda t=task_id: ledger_client().llen(f"test:running:{t}"), 30, 0.05, what="the job to run")
    # While they run: the tracking task reads "started"; the other stored nothing yet and reads as waiting.
    assert job_status(held["tracked"]).state is JobState.STARTED
    assert job_status(held["untracked"]).state.waiting
    for task_id in held.values():
        ledger_client().set(f"test:release:{task_id}", 1, ex=300)
    for task_id in held.values():
        wait_for(lambda t=task_id: job_status(t).state is JobState.SUCCEEDED, 30, 0.1, what="success")


@pytest.fixture(scope="module")
def io_profile(work_dir: Path, redis_server: RedisServer) -> Iterator[tuple[str, int, Path]]:
    """`pipeline worker --processes 2` (the asyncio pool) on a queue of its own, with a /metrics port and short time
    limits."""
    queue = f"io-{uuid.uuid4().hex[:6]}"
    port = free_port()
    multiproc = work_dir / f"multiproc-{queue}"
    multiproc.mkdir()
    env = {
        "METRICS_PORT": str(port),
        "METRICS_ADDRESS": "127.0.0.1",
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "TASK_SOFT_TIME_LIMIT": "4",
        "TASK_TIME_LIMIT": "6",
        "STALL_TIMEOUT": "2",  # a heartbeat older than 2 s is stale: jobs below run longer than that
        "WORKER_HEALTH_DIR": str(multiproc),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    worker = Worker(queue, work_dir / "logs", env)
    worker.argv = [sys.executable, "-m", "pipeline", "worker", "--processes", "2", "--app", "tests.support.worker_app"]
    worker.argv += ["-Q", queue, "-l", "INFO", "--without-gossip", "--without-mingle"]
    worker.start()
    try:
        wait_for(lambda: worker.log().count(" ready.") == 2, 60, 0.2, what="both workers ready")
        assert "worker profile short: asyncio pool, 150 jobs in flight at most" in worker.log()
        yield queue, port, multiproc
    finally:
        worker.stop()


def test_io_profile_dead_letters_and_counts(io_profile: tuple[str, int, Path]) -> None:
    queue, port, _ = io_profile
    ok = [ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue) for _ in range(6)]
    failing = ledger.task.apply_async(({"key": uuid.uuid4().hex, "fail": "permanent"},), queue=queue)
    for result in ok:
        result.get(timeout=30)
    entry = dead_letter(str(failing.id))
    assert entry.exception_type == "pipeline.errors.PermanentError"
    labels = {"task": "test.ledger", "queue": queue}
    wait_for(lambda: value(scrape(port), "pipeline_tasks_total", outcome="succeeded", **labels) == 6, 15, 0.2)
    assert value(scrape(port), "pipeline_tasks_total", outcome="failed", **labels) == 1
    assert value(scrape(port), "pipeline_workers_up", queue=queue) == 2


@pytest.mark.parametrize(
    ("task", "payload", "exception"),
    [
        (awaiting, {"mode": "hang"}, "billiard.exceptions.SoftTimeLimitExceeded"),  # a coroutine, cancelled
        (ledger, {"sleep_s": 30, "fail": "hang"}, "billiard.exceptions.TimeLimitExceeded"),  # a sync job on a thread
    ],
)
def test_io_profile_enforces_time_limits(
    io_profile: tuple[str, int, Path], task: Any, payload: dict[str, Any], exception: str
) -> None:
    queue, _, _ = io_profile
    job = task.task.apply_async(({"key": uuid.uuid4().hex, **payload},), queue=queue, soft_time_limit=1, time_limit=2)
    entry = dead_letter(str(job.id), timeout=30)
    assert entry.exception_type == exception
    assert entry.attempts == 1
    # The worker that ran it is still there and takes the next job.
    assert ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue).get(timeout=30)


def test_io_profile_stays_healthy_while_a_job_blocks_its_event_loop(io_profile: tuple[str, int, Path]) -> None:
    queue, _, health_dir = io_profile
    health = [sys.executable, "-m", "pipeline", "worker-health", "--node", "io*@%h"]
    env = {**os.environ, "WORKER_HEALTH_DIR": str(health_dir)}
    key = uuid.uuid4().hex
    job = ledger.task.apply_async(({"key": key, "sleep_s": 3.5},), queue=queue)  # past STALL_TIMEOUT, within limits
    wait_for(lambda: attempts(key), 30, 0.05, what="the job to start")
    verdicts = []
    while not job.ready():
        verdicts.append(subprocess.run(health, env=env, capture_output=True, text=True, check=False))
    assert job.get(timeout=5)["attempt"] == 1
    assert verdicts and all(v.returncode == 0 for v in verdicts), [v.stdout + v.stderr for v in verdicts]


def test_io_profile_honours_a_cluster_rate_limit(io_profile: tuple[str, int, Path], redis_server: RedisServer) -> None:
    queue, _, _ = io_profile
    redis_server.client().delete("pipeline:ratelimit:test.limited")
    key, jobs, rate = uuid.uuid4().hex, 30, 20
    results = [limited.task.apply_async(({"key": key, "n": i},), queue=queue) for i in range(jobs)]
    wait_for(lambda: len(starts(key)) >= jobs, jobs / rate + 40, 0.2, what=f"{jobs} rate-limited jobs")
    times = starts(key)
    assert len(times) == jobs
    peak = max(sum(1 for t in times if start <= t < start + 1) for start in times)
    assert peak <= rate * 1.1, f"{peak} starts in one second"
    assert times[-1] - times[0] >= (jobs - 1) / rate - 1  # the limit set the pace, not two idle workers
    assert all(r.get(timeout=30)["attempt"] == 1 for r in results)


def test_results_are_stored_in_one_round_trip_and_a_success_is_never_overwritten(redis_server: RedisServer) -> None:
    from pipeline.compat.results import RedisBackend

    backend = get_app().backend
    assert isinstance(backend, RedisBackend)
    task_id = str(uuid.uuid4())
    client = redis_server.client()
    with client.monitor() as monitor:
        backend.store_result(task_id, {"n": 1}, "PROGRESS")
        line = monitor.next_command()
        while task_id not in line["command"]:  # other clients of the session's Redis (workers, their threads)
            line = monitor.next_command()
    assert line["command"].split()[0] in ("EVALSHA", "EVAL"), line  # one call: no GET ahead of the write
    backend.store_result(task_id, {"ok": True}, "SUCCESS")
    backend.mark_as_failure(task_id, RuntimeError("a late redelivery failed"))
    meta = backend.get_task_meta(task_id, cache=False)
    assert (meta["status"], meta["result"]) == ("SUCCESS", {"ok": True})
    assert 0 < client.ttl(backend.get_key_for_task(task_id)) <= get_app().conf.result_expires


@pytest.fixture(scope="module")
def solo_profile(work_dir: Path) -> Iterator[str]:
    """`pipeline worker --pool solo --processes 1` on a queue of its own."""
    queue = f"solo-{uuid.uuid4().hex[:6]}"
    worker = Worker(queue, work_dir / "logs", {})
    worker.argv = [sys.executable, "-m", "pipeline", "worker", "--pool", "solo", "--processes", "1"]
    worker.argv += ["--app", "tests.support.worker_app", "-Q", queue, "-l", "INFO"]
    worker.argv += ["--without-gossip", "--without-mingle"]
    worker.start()
    try:
        assert "worker profile short: prefetch 4 per process" in worker.log()
        yield queue
    finally:
        worker.stop()


def test_io_profile_stores_each_result_in_the_call_that_acknowledges_its_job(
    solo_profile: str, redis_server: RedisServer
) -> None:
    """A solo worker stores each job's SUCCESS in a script that also acknowledges (one round trip for both), and a
    lone job's result is not held back: the tick writes it once the worker is idle."""
    queue = solo_profile
    lone = ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue)
    assert lone.get(timeout=10)["attempt"] == 1  # the worker went idle after it: the tick wrote it
    client = redis_server.client()
    with client.monitor() as monitor:
        jobs = [ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue) for _ in range(12)]
        keys = {f"celery-task-meta-{job.id}" for job in jobs}
        scripts: dict[str, list[str]] = {}  # task key -> the commands of the script that stored its SUCCESS
        current: list[str] | None = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = monitor.next_command()
            if line["client_type"] != "lua":
                current = None
                if len(scripts) == len(keys):
                    break  # the script that stored the last result has ended
                continue
            words = line["command"].split()
            if current is None:
                current = []
            current.append(" ".join(words[:2]))
            if words[0] in ("SETEX", "SET") and words[1] in keys and '"status":"SUCCESS"' in line["command"]:
                scripts[words[1]] = current  # the same list keeps growing until the script ends
    assert all(job.get(timeout=10)["attempt"] == 1 for job in jobs)
    assert set(scripts) == keys
    for key, commands in scripts.items():
        assert "HDEL unacked" in commands, (key, commands)  # stored and acknowledged by one script


def test_io_profile_sigterm_during_a_job_requeues_it_at_once(work_dir: Path, redis_server: RedisServer) -> None:
    """A solo worker runs the job in the thread that handles the signal: a soft shutdown could only pause it,
    so the job goes back to its queue at once (run again: jobs are idempotent) and the worker exits."""
    queue = f"io-stop-{uuid.uuid4().hex[:6]}"
    worker = Worker(queue, work_dir / "logs", {"WORKER_SOFT_SHUTDOWN_TIMEOUT": "20"})
    worker.argv = [sys.executable, "-m", "pipeline", "worker", "--pool", "solo", "--processes", "1"]
    worker.argv += ["--app", "tests.support.worker_app"]
    worker.argv += ["-Q", queue, "-l", "INFO", "--without-gossip", "--without-mingle"]
    worker.start()
    try:
        key = uuid.uuid4().hex
        job = ledger.task.apply_async(({"key": key, "sleep_s": 30},), queue=queue)
        wait_for(lambda: attempts(key), 30, 0.05, what="the job to start")
        worker.terminate()
        code = worker.wait(15)  # well within WORKER_SOFT_SHUTDOWN_TIMEOUT: no soft-shutdown sleep
    finally:
        worker.stop()
    assert code == 0
    assert waiting(redis_server.client(), queue) == 1, "the interrupted job is back on its queue"
    assert len(attempts(key)) == 1
    assert ledger.task.AsyncResult(job.id).state == "PENDING", "neither failed nor dead-lettered"


def test_io_profile_supervisor_restarts_a_worker_that_died(io_profile: tuple[str, int, Path]) -> None:
    queue, _, _ = io_profile
    nodes = [f"io{i}@{socket.gethostname()}" for i in (1, 2)]
    victim = ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue).get(timeout=30)["pid"]
    os.kill(victim, signal.SIGKILL)
    # The supervisor starts a worker in its place, under the same node name: both nodes answer again.
    wait_for(lambda: len(get_app().control.ping(destination=nodes, timeout=0.5)) == 2, 60, 0.5, what="two nodes")
    pids = {ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=queue).get(timeout=30)["pid"] for _ in range(8)}
    assert victim not in pids
