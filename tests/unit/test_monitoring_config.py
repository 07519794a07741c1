"""deploy/prometheus and deploy/grafana: promtool checks and unit tests, and every query names a real metric.

promtool comes from Debian's `prometheus` package (`make system-deps`); a missing promtool fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from pipeline.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"

#: Flower's /metrics (flower/events.py) and redis_exporter's documented names that dashboards may use.
FLOWER_METRICS = {
    "flower_events_total",
    "flower_task_runtime_seconds_bucket",
    "flower_task_runtime_seconds_sum",
    "flower_task_runtime_seconds_count",
    "flower_task_prefetch_time_seconds",
    "flower_worker_prefetched_tasks",
    "flower_worker_online",
    "flower_worker_number_of_currently_executing_tasks",
}
REDIS_EXPORTER_METRICS = {
    "redis_up",
    "redis_memory_used_bytes",
    "redis_memory_max_bytes",
    "redis_connected_clients",
    "redis_rejected_connections_total",
}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
}


def exported_names() -> set[str]:
    """Every sample name the project serves: pipeline.observability.metrics' families plus the exporter's gauges."""
    names = set(metrics.QUEUE_FAMILIES)
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, groupings, ranges and functions removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in _PROMQL_WORDS:
            continue
        found.add(match.group())
    return found


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make system-deps` (Debian package `prometheus`)"
    return subprocess.run([exe, *args], cwd=PROM, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(
    "args",
    [("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml")],
)
def test_promtool(args: tuple[str, ...]) -> None:
    done = promtool(*args)
    assert done.returncode == 0, done.stdout + done.stderr


def test_metric_name_extraction() -> None:
    expr = 'sum by (queue) (rate(pipeline_tasks_total{outcome="failed"}[5m])) / on (queue) redis_up > 0.5'
    assert metric_names(expr) == {"pipeline_tasks_total", "redis_up"}


def test_every_alert_has_a_unit_test_and_reads_exported_metrics() -> None:
    rules = [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    known = exported_names() | REDIS_EXPORTER_METRICS
    for rule in rules:
        assert rule["alert"] in tested, f"alert {rule['alert']} has no firing unit test"
        assert metric_names(rule["expr"]) <= known, (rule["alert"], metric_names(rule["expr"]) - known)
    assert {r["alert"] for r in rules} >= {
        "PipelineQueueWaitHigh",
        "PipelineDeadLetterQueueGrowing",
        "PipelineNoWorkerForQueue",
        "PipelineTaskFailureRatioHigh",
        "PipelineDelayedJobsOverdue",
        "RedisMemoryHigh",
    }


def test_prometheus_scrapes_workers_exporter_flower_and_redis() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"worker-io:9808", "worker-cpu:9808", "exporter:9809", "flower:5555", "redis-exporter:9121"} <= targets


def test_dashboard_queries_name_only_exported_metrics() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "pipeline.json").read_text())
    known = exported_names() | FLOWER_METRICS | REDIS_EXPORTER_METRICS
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"no metric in {target['expr']!r}"
            assert names <= known, (panel["title"], names - known)
            used |= names
    # The dashboard covers every figure the issue lists.
    for name in (
        "pipeline_tasks_total",
        "pipeline_task_runtime_seconds_bucket",
        "pipeline_task_queue_wait_seconds_bucket",
        "pipeline_queue_depth",
        "pipeline_queue_in_flight",
        "pipeline_queue_oldest_age_seconds",
        "pipeline_dlq_size",
        "pipeline_rate_limit_throttled_total",
        "pipeline_signal_handler_errors_total",
        "pipeline_workers_up",
        "pipeline_delayed_jobs",
        "pipeline_delayed_overdue_seconds",
        "pipeline_flows_total",
        "pipeline_flow_steps_total",
        "pipeline_flow_step_duration_seconds_bucket",
    ):
        assert name in used, f"the dashboard shows nothing of {name}"


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    dashboard = json.loads((GRAFANA / "dashboards" / "pipeline.json").read_text())
    assert all(p["datasource"]["uid"] == uid for p in dashboard["panels"])
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pipeline.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
