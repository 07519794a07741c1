"""Typed jobs end to end on a Redis Cluster: enqueued with the `pipeline` command (the pipeline's own producer) onto
queues served by different masters, run by a worker on the cluster URL, each delivered once at its side effect, and
their results read back with `pipeline status --json`; a delayed job parked on the cluster, released and run once;
`pipeline worker` runs the asyncio pool there by default, and solo processes when asked.

A real 3+3 cluster (`redis_cluster`), a `celery worker` subprocess on the cluster URL, the webhooks' endpoint a real
HTTP server on loopback (`tests.support.http_peer`) that records each request. The result backend is a redis-server
of its own here (RESULT_BACKEND_URL; results on the cluster itself: `test_cluster_results.py`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import key_slot

from pipeline.queues import keys
from tests.faults.asyncpool_workers import children
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S
from tests.support.cli import run_pipeline
from tests.support.cluster import Cluster
from tests.support.cluster_flows import ITEMS
from tests.support.http_peer import HttpPeer
from tests.support.procs import ROOT, RedisServer, Worker, run_python, wait_for

pytestmark = pytest.mark.faults

#: The probe's queue and the webhooks' queue: their slots are served by different masters of a 3-master cluster.
PROBES, WEBHOOKS = "default", "webhooks"
#: Parked longer than DELAYED_RELEASE_AHEAD (2 s), so the job waits in the delayed set before its release.
#: Long enough that two CLI calls (enqueue, then status: each a Python start, seconds on a loaded 2-core machine)
#: end before the job is due, so its status can be read while it is parked.
COUNTDOWN_S = 15.0


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    server = HttpPeer().start()
    yield server
    server.stop()


def _env(cluster: Cluster, results: RedisServer) -> dict[str, str]:
    return {"REDIS_URL": cluster.url(), "RESULT_BACKEND_URL": results.url, **SHORT_LEASE}


def _cli(env: dict[str, str], *argv: str) -> Any:
    """`pipeline ARGV --json` in a process of its own on the cluster: its JSON output."""
    done = run_pipeline(*argv, "--json", env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def _webhook(peer: HttpPeer, hook: str, n: int) -> str:
    return json.dumps({"url": peer.url(hook), "event": "cluster.test", "payload": {"n": n}})


def _past_two_leases(peer: HttpPeer, hook: str) -> None:
    """Wait until 2 x LEASE_SECONDS after the endpoint's last request."""
    last = max(r.t for r in peer.received(hook))
    wait_for(lambda: time.time() >= last + 2 * SHORT_LEASE_S, 6 * SHORT_LEASE_S, 0.2, what="two leases past the last")


def _stored(results: RedisServer, ids: list[str]) -> bool:
    """Every job's result is in the result backend (what `pipeline status` reads)."""
    return all(results.client().exists(f"celery-task-meta-{task_id}") for task_id in ids)


def _statuses(env: dict[str, str], ids: list[str]) -> dict[str, dict[str, Any]]:
    return {task_id: _cli(env, "status", task_id) for task_id in ids}


def test_typed_jobs_on_two_masters_run_once_and_their_results_are_read_back(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, peer: HttpPeer
) -> None:
    masters = {q: redis_cluster.master_of(key_slot(q.encode())).port for q in (PROBES, WEBHOOKS)}
    assert masters[PROBES] != masters[WEBHOOKS], masters
    env, hook, n = _env(redis_cluster, ledger_redis), f"/hook/{uuid.uuid4().hex}", 6
    webhooks = [_cli(env, "enqueue", "webhook", _webhook(peer, hook, i))["id"] for i in range(2)]
    batch = [json.loads(_webhook(peer, hook, i)) for i in range(2, n)]
    webhooks += _cli(env, "enqueue-many", "webhook", json.dumps(batch))["ids"]
    probes = _cli(env, "enqueue-many", "probe", json.dumps([{"message": f"p{i}"} for i in range(n)]))["ids"]
    make_worker(f"cl-jobs-{hook[-6:]}", env=env, queues=f"{PROBES},{WEBHOOKS}", concurrency=2)

    wait_for(lambda: len(peer.received(hook)) >= n, 120, 0.2, what="every webhook at the endpoint")
    _past_two_leases(peer, hook)
    bodies = collections.Counter(json.loads(r.body)["payload"]["n"] for r in peer.received(hook))
    assert bodies == collections.Counter(range(n)), "each webhook delivered once"
    wait_for(lambda: _stored(ledger_redis, probes + webhooks), 60, 0.2, what="every job's result stored")
    statuses = _statuses(env, probes + webhooks)
    assert {s["state"] for s in statuses.values()} == {"succeeded"}, statuses
    assert [statuses[p]["result"]["message"] for p in probes] == [f"p{i}" for i in range(n)]
    assert all(statuses[p]["result"]["attempt"] == 1 for p in probes)
    assert all(statuses[w]["result"]["status_code"] == 200 for w in webhooks)
    assert all(statuses[w]["result"]["attempts"] == 1 for w in webhooks)


def test_a_delayed_job_is_released_and_runs_once_on_the_cluster(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, peer: HttpPeer
) -> None:
    env, hook = _env(redis_cluster, ledger_redis), f"/hook/{uuid.uuid4().hex}"
    make_worker(f"cl-later-{hook[-6:]}", env=env, queues=WEBHOOKS, concurrency=1)
    sent = time.time()
    job = _cli(env, "enqueue", "webhook", _webhook(peer, hook, 0), "--delay", str(COUNTDOWN_S))["id"]
    parked = _cli(env, "status", job)
    assert parked["state"] == "scheduled", parked
    wait_for(lambda: peer.received(hook), 60, 0.1, what="the delayed webhook at the endpoint")
    [request] = peer.received(hook)
    assert request.t >= sent + COUNTDOWN_S - 0.5, "not run before it was due"
    _past_two_leases(peer, hook)
    assert len(peer.received(hook)) == 1, "run once"
    wait_for(lambda: _cli(env, "status", job)["state"] == "succeeded", 30, 0.3, what="the delayed job's result")
    assert _cli(env, "status", job)["result"]["attempts"] == 1


#: Releasers move a parked job this long before it is due (DELAYED_RELEASE_AHEAD): well below COUNTDOWN_S.
SHORT_AHEAD = {"DELAYED_RELEASE_AHEAD": "0.5"}

_ENQUEUE_ITEM = """
import json, sys
from tests.support.cluster_flows import SpreadJob, spread_item
job = spread_item.enqueue(SpreadJob(key=sys.argv[1]), countdown=float(sys.argv[2]))
print(json.dumps({"queue": spread_item.queue, "id": job}))
"""


def test_a_delayed_job_of_a_task_with_a_queue_of_its_own_is_released_and_runs_once_on_the_cluster(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """A typed task's own queue (`test.spread_item` on ITEMS, no work queue) parks a delayed job in that queue's slot:
    the releaser of a worker consuming it releases it there, and `pipeline status` finds it parked meanwhile."""
    env = {**_env(redis_cluster, ledger_redis), "TEST_LEDGER_URL": ledger_redis.url, **SHORT_AHEAD}
    key = f"own-later-{uuid.uuid4().hex[:8]}"
    make_worker(key, env=env, queues=ITEMS, concurrency=1)
    done = run_python(env, "-c", _ENQUEUE_ITEM, key, str(COUNTDOWN_S))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["queue"] == ITEMS
    node = redis_cluster.master_of(key_slot(ITEMS.encode())).client()
    assert node.zscore(keys.delayed(ITEMS, True)[0], out["id"]) is not None, "parked in its queue's slot"
    parked = _cli(env, "status", out["id"])
    assert parked["state"] == "scheduled" and parked["due_at"], parked
    due = datetime.fromisoformat(parked["due_at"]).timestamp()
    ledger = ledger_redis.client()
    wait_for(lambda: ledger.llen(f"test:ledger:{key}:item"), 60, 0.2, what="the delayed job to run")
    wait_for(lambda: time.time() >= due + 2 * SHORT_LEASE_S, 60, 0.2, what="two leases past its due time")
    runs = [json.loads(r) for r in ledger.lrange(f"test:ledger:{key}:item", 0, -1)]
    assert [r["task_id"] for r in runs] == [out["id"]], "run once"
    assert runs[0]["t"] >= due - 0.5, "not run before it was due"
    wait_for(lambda: _cli(env, "status", out["id"])["state"] == "succeeded", 30, 0.3, what="the delayed job's result")


_OWN_QUEUE = """
import json
from pydantic import BaseModel
from pipeline.task import typed_task
class Job(BaseModel):
    n: int
def run(job, ctx):
    return job
own = typed_task("test.own_queue", kind="test-own-queue", payload=Job, result=Job, public=False, queue="own-queue")(run)
print(json.dumps({"queue": own.queue, "ids": [own.enqueue({"n": 0}), *own.enqueue_many([{"n": 1}, {"n": 2}])]}))
"""


def test_a_typed_task_with_a_queue_of_its_own_enqueues_on_the_cluster(
    redis_cluster: Cluster, ledger_redis: RedisServer
) -> None:
    """The job's recent-jobs entry goes to the queue the message goes to, the task's own (not the default queue's):
    on a cluster one script writes both, so they must share the queue's slot."""
    env = {**os.environ, **_env(redis_cluster, ledger_redis)}
    done = subprocess.run(
        [sys.executable, "-c", _OWN_QUEUE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["queue"] == "own-queue"
    node = redis_cluster.master_of(key_slot(b"own-queue")).client()
    lists = keys.levels("own-queue", True)
    waiting = [json.loads(m)["headers"]["id"] for key in lists for m in node.lrange(key, 0, -1)]
    assert sorted(waiting) == sorted(out["ids"])
    recent = {m.decode() for m in node.zrange(keys.recent("own-queue", True), 0, -1)}
    assert recent == set(out["ids"])


def _pipeline_worker(name: str, work_dir: Path, env: dict[str, str], *argv: str, queues: str = PROBES) -> Worker:
    """`pipeline worker --processes 1 ARGV -Q QUEUES` on the cluster (not started)."""
    worker = Worker(name, work_dir / "logs", env)
    worker.argv = [sys.executable, "-m", "pipeline", "worker", "--processes", "1", *argv, "-Q", queues, "-l", "INFO"]
    return worker


@contextlib.contextmanager
def _running(worker: Worker, pool: bytes) -> Iterator[list[int]]:
    """`worker` (`pipeline worker`) started, its one process running `pool`: that process's PID; both stopped after."""
    worker.start()
    kids = children(worker.pid)
    try:
        assert [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[6:8] for pid in kids] == [[b"-P", pool]]
        yield kids
    finally:
        worker.stop()
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_pipeline_worker_runs_the_asyncio_pool_on_a_cluster_with_typed_async_jobs(
    redis_cluster: Cluster, ledger_redis: RedisServer, work_dir: Path, peer: HttpPeer
) -> None:
    """`pipeline worker` on a cluster URL runs the asyncio pool, as on a single Redis: typed async jobs (webhooks to a
    local endpoint, on a queue of another master than the probes') each delivered once, their results read back;
    it stops on SIGTERM with status 0."""
    env, hook, n = _env(redis_cluster, ledger_redis), f"/hook/{uuid.uuid4().hex}", 8
    worker = _pipeline_worker(f"cl-pw-{hook[-6:]}", work_dir, env, queues=f"{PROBES},{WEBHOOKS}")
    with _running(worker, b"custom") as kids:
        batch = [json.loads(_webhook(peer, hook, i)) for i in range(n)]
        hooks = _cli(env, "enqueue-many", "webhook", json.dumps(batch))
        probe = _cli(env, "enqueue", "probe", "{}")["id"]
        wait_for(lambda: len(peer.received(hook)) >= n, 60, 0.2, what="every webhook at the endpoint")
        _past_two_leases(peer, hook)
        bodies = collections.Counter(json.loads(r.body)["payload"]["n"] for r in peer.received(hook))
        assert bodies == collections.Counter(range(n)), "each webhook delivered once"
        wait_for(lambda: _stored(ledger_redis, [probe, *hooks["ids"]]), 60, 0.2, what="every job's result stored")
        statuses = _statuses(env, [probe, *hooks["ids"]])
        assert {s["state"] for s in statuses.values()} == {"succeeded"}, statuses
        assert all(statuses[w]["result"]["attempts"] == 1 for w in hooks["ids"])
        worker.terminate()
        assert worker.wait(40) == 0, worker.log()[-3000:]
        assert not [pid for pid in kids if Path(f"/proc/{pid}").exists()], "every worker process has exited"


def test_pipeline_worker_pool_solo_runs_on_a_cluster_and_stops_on_sigterm(
    redis_cluster: Cluster, ledger_redis: RedisServer, work_dir: Path
) -> None:
    env = _env(redis_cluster, ledger_redis)
    worker = _pipeline_worker(f"cl-solo-{uuid.uuid4().hex[:6]}", work_dir, env, "--pool", "solo")
    with _running(worker, b"solo"):
        job = _cli(env, "enqueue", "probe", "{}")["id"]
        wait_for(lambda: _cli(env, "status", job)["state"] == "succeeded", 60, 0.5, what="the probe to succeed")
        worker.terminate()
        assert worker.wait(40) == 0, worker.log()[-3000:]
