"""Paused queues (`pipeline.scheduling.pause`): a real worker starts none of a paused queue's jobs, including the ones
it already holds, loses none, and starts them all once when the queue is resumed; the CLI and the exporter show it,
for a work queue and for a queue of a task's own alike (any queue the app routes to)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.broker import queue_keys
from pipeline.browse.listing import browse
from pipeline.browse.model import MAX_LIMIT, BrowseState
from pipeline.config import get_settings
from pipeline.constants import DELIVERIES_KEY, PAUSED_KEY, UNACKED_KEY
from pipeline.observability.exporter import QueueCollector
from pipeline.observability.health import health_path
from tests.support.cli import run_cli
from tests.support.cluster_flows import ITEMS, spread_item
from tests.support.procs import RedisServer, Worker, wait_for
from tests.support.scrape import value
from tests.support.worker_app import app, attempts, ledger_client

pytestmark = pytest.mark.integration


def _fetches(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_paused_queue_starts_nothing_loses_nothing_and_runs_everything_once_resumed(
    redis_server: RedisServer, make_worker: Callable[..., Worker]
) -> None:
    """A solo worker with prefetch 4 on a queue of its own (the session's workers consume every work queue; sending
    to it makes it a queue this process's app routes to, which `pipeline queues pause` takes): paused from the start,
    its jobs stay queued and the idle worker does not spin; resumed, the worker takes all four in one batch within a
    second; paused while the first runs, the first finishes and the other three go back to the queue unstarted;
    resumed again, each of the four has run exactly once."""
    client = redis_server.client()
    name = f"pause-{uuid.uuid4().hex[:8]}"
    queue, key, node = name, name, f"{name}@{socket.gethostname()}"
    ids = [
        app.send_task("test.ledger", args=[{"key": key, "sleep_s": 0.8 if i == 0 else 0}], queue=queue).id
        for i in range(4)
    ]
    try:
        _switch("pause", queue)
        env = {"WORKER_PREFETCH_MULTIPLIER": "4", "STALL_TIMEOUT": "1"}
        worker = make_worker(name, env, queues=queue, pool="solo", concurrency=1)
        before = _fetches(client)
        time.sleep(2)  # longer than an idle worker's wait while its queues are paused, and than STALL_TIMEOUT
        assert attempts(key) == [] and sum(client.llen(k) for k in queue_keys(queue)) == 4
        assert _fetches(client) - before < 40  # it waits between fetches (a busy loop makes thousands)
        # Jobs of a paused queue wait by design: the stall watchdog does not call the worker stuck.
        health = run_cli("worker-health", "--node", node)
        assert health.returncode == 0 and "worker stalled" not in worker.log(), health.stderr

        resumed = time.time()
        _switch("resume", queue)
        wait_for(lambda: attempts(key), 2, what="the first job to start")
        assert attempts(key)[0]["t"] - resumed < 1.0
        assert attempts(key)[0]["task_id"] == ids[0]
        assert sum(client.llen(k) for k in queue_keys(queue)) == 0  # the worker holds all four: one batch
        _switch("pause", queue)  # while the first job runs

        wait_for(lambda: client.llen(f"test:done:{key}") >= 1, 5, what="the running job to finish")
        wait_for(lambda: sum(client.llen(k) for k in queue_keys(queue)) == 3, 2, what="the held jobs to go back")
        time.sleep(0.3)
        assert [a["task_id"] for a in attempts(key)] == [ids[0]]  # running jobs finish; held ones never start
        held = [json.loads(raw) for k in queue_keys(queue) for raw in client.lrange(k, 0, -1)]
        assert sorted(m["headers"]["id"] for m in held) == sorted(ids[1:]) and not _unacked(client, ids)
        tags = [m["properties"]["delivery_tag"] for m in held]
        assert client.hmget(DELIVERIES_KEY, tags) == [b"0"] * 3  # never started: no delivery toward the limit

        _switch("resume", queue)
        wait_for(lambda: ledger_client().llen(f"test:done:{key}") == 4, 5, what="every job to run")
        assert sorted(a["task_id"] for a in attempts(key)) == sorted(ids)  # each exactly once
    finally:
        client.srem(PAUSED_KEY, queue)
        client.delete(*queue_keys(queue))
        with contextlib.suppress(FileNotFoundError):
            health_path(get_settings().worker_health_dir, node).unlink()


def _switch(action: str, queue: str) -> None:
    done = run_cli("queues", action, queue, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["changed"] is True, done.stdout + done.stderr


def _unacked(client: Any, ids: list[str]) -> list[str]:
    """The jobs among `ids` a worker holds (kombu's `unacked`)."""
    return [i for raw in client.hvals(UNACKED_KEY) if (i := json.loads(raw)[0]["headers"]["id"]) in ids]


def _state(queue: str) -> dict[str, Any]:
    shown = run_cli("queues", "--json")
    assert shown.returncode == 0, shown.stderr
    return next(q for q in json.loads(shown.stdout)["queues"] if q["name"] == queue)


def _samples(collector: QueueCollector) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for family in collector.collect() for s in family.samples}


def test_pause_and_resume_from_the_cli_show_in_queues_and_the_metric(redis_server: RedisServer) -> None:
    paused = run_cli("queues", "pause", "webhooks", "--json")
    try:
        assert paused.returncode == 0 and json.loads(paused.stdout) == {
            "name": "webhooks",
            "paused": True,
            "changed": True,
        }
        assert run_cli("queues", "pause", "webhooks").stdout.strip() == "webhooks: paused (it was paused already)"
        assert _state("webhooks")["paused"] is True and _state("email")["paused"] is False
        table = run_cli("queues").stdout.splitlines()
        assert next(line for line in table if line.startswith("webhooks")).split()[-1] == "paused"
        assert next(line for line in table if line.startswith("email")).split()[-1] == "running"
        samples = _samples(QueueCollector(("webhooks", "email")))
        assert value(samples, "pipeline_queue_paused", queue="webhooks") == 1
        assert value(samples, "pipeline_queue_paused", queue="email") == 0

        unknown = run_cli("queues", "pause", "nope")
        assert unknown.returncode == 2 and "no queue 'nope' the app routes to" in unknown.stderr
        dlq = run_cli("queues", "resume", "dead_letter", "--json")
        assert dlq.returncode == 2 and "no consumer" in json.loads(dlq.stdout)["error"]
    finally:
        resumed = run_cli("queues", "resume", "webhooks")
    assert resumed.returncode == 0 and resumed.stdout.strip() == "webhooks: running"
    assert _state("webhooks")["paused"] is False


def test_a_tasks_own_queue_shows_pauses_and_resumes_like_a_work_queue(redis_server: RedisServer) -> None:
    """`test.spread_item` routes to a queue of its own (ITEMS, no work queue; no worker here consumes it): `pipeline
    queues` lists it with its depth, it pauses and resumes, the exporter's default gauges and the job browser show it
    (`pipeline.queues.routed`)."""
    client = redis_server.client()
    before = _state(ITEMS)["depth"]
    ids = [spread_item.enqueue({"key": f"own-{uuid.uuid4().hex[:8]}", "i": i}) for i in range(2)]
    try:
        assert _state(ITEMS)["depth"] == before + 2 and _state(ITEMS)["paused"] is False
        _switch("pause", ITEMS)
        assert _state(ITEMS)["paused"] is True
        row = next(line for line in run_cli("queues").stdout.splitlines() if line.startswith(f"{ITEMS} "))
        assert row.split()[1] == str(before + 2) and row.split()[-1] == "paused"
        samples = _samples(QueueCollector())  # the exporter's default: every queue the app routes to
        assert value(samples, "pipeline_queue_depth", queue=ITEMS) == before + 2
        assert value(samples, "pipeline_queue_paused", queue=ITEMS) == 1
        page = browse(ITEMS, BrowseState.WAITING, limit=MAX_LIMIT)
        assert set(ids) <= {job.id for job in page.jobs} and page.counts[ITEMS][BrowseState.WAITING] == before + 2
        _switch("resume", ITEMS)
        assert _state(ITEMS)["paused"] is False
    finally:
        run_cli("queues", "resume", ITEMS)
        client.delete(*queue_keys(ITEMS))
