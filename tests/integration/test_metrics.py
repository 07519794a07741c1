"""Worker metrics over HTTP from a real prefork worker (concurrency 2) started by the real start script,
and from plain `celery worker` commands that prepare their own multiprocess directory.

The classic bug this guards against: an endpoint in the worker's main process that sees only its own
registry reports fewer tasks than ran (each pool child counted into its own memory).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tasks.probe import probe
from tests.support.flow_client import FlowClient
from tests.support.procs import ROOT, RedisServer, Worker, free_port, wait_for
from tests.support.scrape import Samples, scrape, try_scrape, value
from tests.support.worker_app import attempts, ledger

pytestmark = pytest.mark.integration
QUEUE = "obs-metrics"


class MetricsWorker(Worker):
    port: int


@pytest.fixture(scope="module")
def metrics_worker(work_dir: Path) -> Iterator[MetricsWorker]:
    multiproc = work_dir / "metrics-multiproc"
    multiproc.mkdir(parents=True, exist_ok=True)
    stale = multiproc / "counter_999999.db"
    stale.write_bytes(b"stale file from an earlier run")
    port = free_port()
    env = {
        "METRICS_PORT": str(port),
        "METRICS_ADDRESS": "127.0.0.1",
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "CELERY_APP": "tests.support.worker_app",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "METRICS_SWEEP_INTERVAL": "1",
    }
    worker = MetricsWorker("metrics", work_dir / "logs", env)
    worker.port = port
    script = ROOT / "deploy" / "docker" / "start-worker"
    worker.argv = [str(script), "-n", "metrics@%h", "-Q", QUEUE, "-P", "prefork", "-c", "2", "--without-gossip"]
    worker.start()
    try:
        assert not stale.exists(), "the start script must wipe the multiprocess directory"
        wait_for(lambda: try_scrape(port), 20, 0.2, what="worker /metrics endpoint")
        yield worker
    finally:
        worker.stop()


def _wait_value(port: int, name: str, expected: float, timeout: float = 20, **labels: str) -> Samples:
    def reached() -> Samples | None:
        samples = scrape(port)
        return samples if value(samples, name, **labels) == expected else None

    try:
        return wait_for(reached, timeout, 0.2, what=f"{name}{labels} == {expected}")  # type: ignore[return-value]
    except TimeoutError:
        raise AssertionError(f"{name}{labels} is {value(scrape(port), name, **labels)}, expected {expected}") from None


def test_prefork_counts_every_task_exactly(metrics_worker: MetricsWorker, redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    n = 16
    for _ in range(n):
        ledger.task.apply_async(({"key": key, "sleep_s": 0.1},), queue=QUEUE)
    wait_for(lambda: redis_server.client().llen(f"test:done:{key}") == n, 60, 0.1, what=f"{n} tasks done")
    pids = {record["pid"] for record in attempts(key)}
    assert len(pids) >= 2, f"both pool children should have run tasks, saw pids {pids}"

    labels = {"task": "test.ledger", "queue": QUEUE}
    samples = _wait_value(metrics_worker.port, "pipeline_tasks_total", n, outcome="succeeded", **labels)
    assert value(samples, "pipeline_task_runtime_seconds_count", **labels) == n
    assert value(samples, "pipeline_task_queue_wait_seconds_count", **labels) == n
    runtime_sum = value(samples, "pipeline_task_runtime_seconds_sum", **labels)
    assert runtime_sum is not None
    assert runtime_sum >= n * 0.1 * 0.9
    assert value(samples, "pipeline_workers_up", queue=QUEUE) == 1
    # A later scrape still says n: nothing is counted twice.
    assert value(scrape(metrics_worker.port), "pipeline_tasks_total", outcome="succeeded", **labels) == n


def test_failures_retries_and_dead_letters_are_counted(
    metrics_worker: MetricsWorker, redis_server: RedisServer, clean_dlq: None
) -> None:
    base = scrape(metrics_worker.port)
    labels = {"task": "test.ledger", "queue": QUEUE}

    def before(outcome: str) -> float:
        return value(base, "pipeline_tasks_total", outcome=outcome, **labels) or 0

    ids = [ledger.task.apply_async(({"key": uuid.uuid4().hex, "fail": "permanent"},), queue=QUEUE).id for _ in range(2)]
    retry_key = uuid.uuid4().hex
    ledger.task.apply_async(({"key": retry_key, "fail": "transient", "fail_times": 1},), queue=QUEUE)
    wait_for(lambda: redis_server.client().llen(f"test:done:{retry_key}") == 1, 30, 0.1, what="retried task done")
    _wait_value(metrics_worker.port, "pipeline_tasks_total", before("failed") + 2, outcome="failed", **labels)
    _wait_value(
        metrics_worker.port, "pipeline_tasks_total", before("dead_lettered") + 2, outcome="dead_lettered", **labels
    )
    samples = _wait_value(
        metrics_worker.port, "pipeline_tasks_total", before("retried") + 1, outcome="retried", **labels
    )
    assert value(samples, "pipeline_tasks_total", outcome="succeeded", **labels) == before("succeeded") + 1
    envelopes = [json.loads(raw) for raw in redis_server.client().lrange("dead_letter", 0, -1)]
    assert len(envelopes) == 2, ids


def test_queue_wait_excludes_countdown_and_includes_real_waiting(
    metrics_worker: MetricsWorker, redis_server: RedisServer
) -> None:
    labels = {"task": "pipeline.probe", "queue": QUEUE}
    base = scrape(metrics_worker.port)
    count0 = value(base, "pipeline_task_queue_wait_seconds_count", **labels) or 0
    sum0 = value(base, "pipeline_task_queue_wait_seconds_sum", **labels) or 0

    # A 2 s countdown is the producer's wish, not waiting: the observed wait stays well under it.
    probe.task.apply_async(({"message": "later"},), queue=QUEUE, countdown=2).get(timeout=30)
    samples = _wait_value(metrics_worker.port, "pipeline_task_queue_wait_seconds_count", count0 + 1, **labels)
    countdown_wait = (value(samples, "pipeline_task_queue_wait_seconds_sum", **labels) or 0) - sum0
    assert 0 <= countdown_wait < 1.5

    # Both pool children busy for 2.5 s: a job published now waits about that long before it starts.
    key = uuid.uuid4().hex
    for _ in range(2):
        ledger.task.apply_async(({"key": key, "sleep_s": 2.5},), queue=QUEUE)
    wait_for(lambda: len(attempts(key)) == 2, 20, 0.05, what="both children busy")
    probe.task.apply_async(({"message": "blocked"},), queue=QUEUE).get(timeout=30)
    samples = _wait_value(metrics_worker.port, "pipeline_task_queue_wait_seconds_count", count0 + 2, **labels)
    blocked_wait = (value(samples, "pipeline_task_queue_wait_seconds_sum", **labels) or 0) - sum0 - countdown_wait
    assert 1.5 <= blocked_wait < 15


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_plain_worker_prepares_and_removes_its_own_multiprocess_dir(
    pool: str, make_worker: object, redis_server: RedisServer, work_dir: Path
) -> None:
    """A worker started by hand (no start script, no PROMETHEUS_MULTIPROC_DIR) counts every task exactly."""
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "the worker must start without the variable"
    tmp = work_dir / f"tmp-plain-{pool}"  # TMPDIR: where the worker makes its directory
    tmp.mkdir(parents=True, exist_ok=True)
    port, queue = free_port(), f"obs-plain-{pool}"
    env = {"METRICS_PORT": str(port), "METRICS_ADDRESS": "127.0.0.1", "TMPDIR": str(tmp), "METRICS_SWEEP_INTERVAL": "1"}
    worker = make_worker(f"plain-{pool}", env=env, queues=queue, pool=pool)  # type: ignore[operator]
    made = list(tmp.glob("pipeline-metrics-*"))
    assert len(made) == 1, made
    assert f"multiprocess directory: {made[0]})" in worker.log()

    key, n = uuid.uuid4().hex, 8
    for _ in range(n):
        ledger.task.apply_async(({"key": key, "sleep_s": 0.1},), queue=queue)
    wait_for(lambda: redis_server.client().llen(f"test:done:{key}") == n, 60, 0.1, what=f"{n} tasks done")
    labels = {"task": "test.ledger", "queue": queue}
    samples = _wait_value(port, "pipeline_tasks_total", n, outcome="succeeded", **labels)
    assert value(samples, "pipeline_task_runtime_seconds_count", **labels) == n
    assert value(samples, "pipeline_workers_up", queue=queue) == 1
    writers = {f.name.rsplit("_", 1)[1] for f in made[0].glob("counter_*.db")}
    if pool == "prefork":
        pids = {str(record["pid"]) for record in attempts(key)}
        assert len(pids) >= 2, f"both pool children should have run tasks, saw pids {pids}"
        assert {f"{pid}.db" for pid in pids} <= writers, "each child counts into its own file"
    assert "worker metrics are OFF" not in worker.log()

    worker.stop()
    assert not made[0].exists(), "the worker removes its directory when it exits"


def test_revoked_counts_as_cancelled_and_rejected_is_counted(metrics_worker: MetricsWorker, clean_dlq: None) -> None:
    from pipeline.celery_app import get_app

    app = get_app()

    labels = {"task": "test.ledger", "queue": QUEUE}
    base = scrape(metrics_worker.port)
    cancelled0 = value(base, "pipeline_tasks_total", outcome="cancelled", **labels) or 0
    rejected0 = value(base, "pipeline_tasks_total", outcome="rejected", **labels) or 0
    dead0 = value(base, "pipeline_tasks_total", outcome="dead_lettered", **labels) or 0

    result = ledger.task.apply_async(({"key": uuid.uuid4().hex},), queue=QUEUE, countdown=2)
    app.control.revoke(result.id)
    _wait_value(metrics_worker.port, "pipeline_tasks_total", cancelled0 + 1, outcome="cancelled", **labels)

    # Pickle is refused by the worker (JSON only): rejected, and dead-lettered.
    app.send_task("test.ledger", args=({"key": "pickled"},), queue=QUEUE, serializer="pickle")
    _wait_value(metrics_worker.port, "pipeline_tasks_total", rejected0 + 1, outcome="rejected", **labels)
    _wait_value(metrics_worker.port, "pipeline_tasks_total", dead0 + 1, outcome="dead_lettered", **labels)


def test_flows_started_succeeded_failed_and_step_durations_on_the_workers_endpoint(
    make_worker: Callable[..., Worker], own_redis: RedisServer, work_dir: Path
) -> None:
    """A prefork worker on a Redis of its own runs a fan-out flow to success and a chain whose second step
    dead-letters; its /metrics counts each flow and step job once, and each step's duration."""
    port = free_port()
    tmp = work_dir / "tmp-flow-metrics"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"REDIS_URL": own_redis.url, "METRICS_PORT": str(port), "METRICS_ADDRESS": "127.0.0.1", "TMPDIR": str(tmp)}
    key = uuid.uuid4().hex
    own_redis.client().set(f"test:flag:{key}:second", "1")  # the chain's second step fails for good
    with FlowClient(own_redis.url) as flows:  # (its process starts while the worker does)
        make_worker("flow-metrics", env=env)
        fan = flows.start("test_fan", {"key": key, "n": 3, "sleep_s": 0.2})
        chain = flows.start("test_chain", {"key": key, "second": "flag"})
        wait_for(lambda: flows.status(fan)["state"] == "succeeded", 30, 0.1, what="the fan-out flow to succeed")
        wait_for(lambda: flows.status(chain)["state"] == "failed", 30, 0.1, what="the chain to fail")

    samples = _wait_value(port, "pipeline_flows_total", 1, flow="test_chain", outcome="failed")
    flows_seen = {
        (flow, outcome): value(samples, "pipeline_flows_total", flow=flow, outcome=outcome)
        for flow in ("test_fan", "test_chain")
        for outcome in ("started", "succeeded", "failed")
    }
    assert flows_seen == {
        ("test_fan", "started"): 1,
        ("test_fan", "succeeded"): 1,
        ("test_fan", "failed"): None,
        ("test_chain", "started"): 1,
        ("test_chain", "succeeded"): None,
        ("test_chain", "failed"): 1,
    }
    steps_seen = {
        (step, outcome): value(samples, "pipeline_flow_steps_total", step=step, outcome=outcome)
        for step in ("split", "join", "first", "second")
        for outcome in ("started", "succeeded", "dead_lettered")
    }
    assert {k: v for k, v in steps_seen.items() if v is not None} == {
        ("split", "started"): 3,
        ("split", "succeeded"): 3,
        ("join", "started"): 1,
        ("join", "succeeded"): 1,
        ("first", "started"): 1,
        ("first", "succeeded"): 1,
        ("second", "started"): 1,
        ("second", "dead_lettered"): 1,
    }
    duration = "pipeline_flow_step_duration_seconds"
    assert value(samples, f"{duration}_count", flow="test_fan", step="split") == 1  # once, when its last item ended
    assert 0.2 <= (value(samples, f"{duration}_sum", flow="test_fan", step="split") or 0) < 20
    assert value(samples, f"{duration}_count", flow="test_fan", step="join") == 1
    assert value(samples, f"{duration}_count", flow="test_chain", step="second") is None  # it never ended
