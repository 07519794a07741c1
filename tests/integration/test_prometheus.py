"""A real Prometheus scraping a plain `celery -A pipeline worker` and `pipeline exporter`, with the real alert rules.

Everything runs against a Redis of its own (no other worker consumes its queues). The worker is started
the way an operator would start it by hand: METRICS_PORT set, no PROMETHEUS_MULTIPROC_DIR, prefork.
Prometheus scrapes both every second and evaluates `deploy/prometheus/alerts.yml` every second; the
test's copy of the rules has every `for:` set to 0s (`instant_rules`), the expressions are the real ones.
Alerts seen firing: DLQ growth and failure ratio (a burst of permanent failures), queue wait (a real
backlog behind slow jobs on the worker's queue), no worker for a queue (jobs where nobody consumes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import ROOT, RedisServer, Worker, free_port, stop_process, wait_for
from tests.support.prometheus import PrometheusServer, instant_rules

pytestmark = pytest.mark.integration
#: A queue the exporter reports and no worker consumes.
BACKLOG = "obs-backlog"
PROBE = 'task="pipeline.probe"'


@dataclass
class Stack:
    env: dict[str, str]
    prometheus: PrometheusServer

    def probes(self, count: int, payload: dict[str, object], *extra: str) -> list[str]:
        """Enqueue `count` probe jobs against this stack's Redis (see tests.support.probes)."""
        argv = [sys.executable, "-m", "tests.support.probes", str(count), json.dumps(payload), *extra]
        out = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60, check=True)
        ids: list[str] = json.loads(out.stdout)
        return ids

    def wait_scalar(self, promql: str, expected: float, timeout: float = 20) -> None:
        try:
            wait_for(lambda: self.prometheus.scalar(promql) == expected, timeout, 0.25, what=promql)
        except TimeoutError:
            raise AssertionError(f"{promql} is {self.prometheus.scalar(promql)}, expected {expected}") from None


@pytest.fixture
def stack(work_dir: Path) -> Iterator[Stack]:
    base = work_dir / f"prometheus-stack-{free_port()}"
    redis = RedisServer(base / "redis").start()
    tmp = base / "tmp"
    tmp.mkdir()
    env = {**os.environ, "REDIS_URL": redis.url, "TMPDIR": str(tmp)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    worker_port, exporter_port = free_port(), free_port()
    worker = Worker("prom", base, {})
    worker.env = {**env, "METRICS_PORT": str(worker_port), "METRICS_ADDRESS": "127.0.0.1"}
    worker.argv = [sys.executable, "-m", "celery", "-A", "pipeline", "worker", "-n", "prom@%h", "-Q", "default"]
    worker.argv += ["-P", "prefork", "-c", "2", "-l", "INFO", "--without-gossip", "--without-mingle"]
    exporter_argv = [str(Path(sys.executable).parent / "pipeline"), "exporter", "--address", "127.0.0.1"]
    exporter_argv += ["--port", str(exporter_port), "--queue", "default", "--queue", BACKLOG]
    rules = instant_rules(ROOT / "deploy" / "prometheus" / "alerts.yml", base / "alerts.yml")
    prometheus = PrometheusServer(base / "prometheus", {"worker": worker_port, "exporter": exporter_port}, [rules])
    exporter: subprocess.Popen[bytes] | None = None
    try:
        with (base / "exporter.log").open("wb") as log:
            exporter = subprocess.Popen(exporter_argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        prometheus.start()
        worker.start()
        yield Stack(env, prometheus)
    finally:
        worker.stop()
        stop_process(exporter)
        prometheus.stop()
        redis.stop()


def test_prometheus_counts_probes_and_fires_the_real_alerts(stack: Stack) -> None:
    prom = stack.prometheus
    # Both targets up, and a first DLQ sample (0) so that growth can be seen.
    stack.wait_scalar('sum(up{job=~"worker|exporter"})', 2)
    stack.wait_scalar("pipeline_dlq_size", 0)

    n = 6
    stack.probes(n, {"message": "counted"}, "--wait")
    stack.wait_scalar(f'sum(pipeline_tasks_total{{{PROBE}, outcome="succeeded"}})', n)

    # Permanent failures in two bursts, each seen by Prometheus: the DLQ grows, and the failed counter
    # increases between samples (a series born at its final value has no rate).
    stack.probes(2, {"fail": "permanent"}, "--wait")
    stack.wait_scalar("pipeline_dlq_size", 2)
    stack.wait_scalar(f'sum(pipeline_tasks_total{{{PROBE}, outcome="failed"}})', 2)
    stack.probes(2, {"fail": "permanent"}, "--wait")
    stack.wait_scalar("pipeline_dlq_size", 4)
    stack.wait_scalar(f'sum(pipeline_tasks_total{{{PROBE}, outcome="dead_lettered"}})', 4)

    # A real backlog on the worker's own queue: 8 jobs of 3 s on 2 pool processes, the last ones wait 6-9 s
    # before they start, so the queue-wait p95 over every job so far is above the 5 s threshold.
    stack.probes(8, {"message": "slow", "sleep_s": 3}, "--wait")
    stack.wait_scalar(f'sum(pipeline_tasks_total{{{PROBE}, outcome="succeeded"}})', n + 8)

    # A backlog where no worker consumes.
    stack.probes(3, {"message": "stuck"}, "--queue", BACKLOG)
    stack.wait_scalar(f'pipeline_queue_depth{{queue="{BACKLOG}"}}', 3)

    def fired() -> set[tuple[str, str]]:
        return {(a["alertname"], a.get("queue", "")) for a in prom.alerts("firing")}

    wanted = {
        ("PipelineDeadLetterQueueGrowing", ""),
        ("PipelineNoWorkerForQueue", BACKLOG),
        ("PipelineTaskFailureRatioHigh", "default"),
        ("PipelineQueueWaitHigh", "default"),
    }
    try:
        wait_for(lambda: wanted <= fired(), 20, 0.5, what="the alerts to fire")
    except TimeoutError:
        raise AssertionError(f"firing: {fired()}; expected at least {wanted}") from None
    assert ("PipelineNoWorkerForQueue", "default") not in fired(), "the worker's queue has a worker"
    assert not {name for name, _ in fired()} & {"PipelineBrokerUnreadable", "PipelineDelayedJobsOverdue"}
    # The successes were counted exactly once, by the worker's one endpoint over both pool children.
    assert prom.scalar(f'sum(pipeline_tasks_total{{{PROBE}, outcome="succeeded"}})') == n + 8
    assert prom.scalar('sum(pipeline_workers_up{queue="default"})') == 1
