"""Operating jobs and flows on a Redis Cluster, with results on the cluster itself (RESULT_BACKEND_URL unset):
`pipeline cancel` of a waiting job and of a running one, a flow cancelled (`pipeline flow cancel`, and
`POST /flows/{id}/cancel` while its fan-out waits on a queue of another master), a fan-out item dead-lettered and
replayed (`pipeline dlq replay`) so the flow runs on to its end, and each step's state as `pipeline flow status` and
`GET /flows/{id}` show it.

A real 3+3 cluster (`redis_cluster`), a `celery worker` subprocess on the cluster URL, the flow `test_spread`
(`tests.support.cluster_flows`: `top` on `default`, 3 items on ITEMS, their join on ENDS, each queue on a master of
its own). Each run is counted where its side effect lands, the ledger (a redis-server of its own), and "never ran"
and "ran once" are read two leases after the last event.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.queues import keys
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S
from tests.integration.test_cancel import alive
from tests.integration.test_cluster_flows import QUEUES, _runs, _start
from tests.support.api import TEST_APP, ApiServer
from tests.support.cluster import Cluster
from tests.support.cluster_flows import ENDS, ITEMS
from tests.support.procs import RedisServer, run_python, wait_for

pytestmark = pytest.mark.faults

QUEUE = "default"  # test.run's route, and `top`'s

#: `pipeline ARGV` with the test flows declared (`test_spread`), in a process of its own.
_PIPELINE = "from tests.support import cluster_flows; from pipeline.cli.main import app; app(prog_name='pipeline')"

_ENQUEUE = """
import json, sys
from tests.support.cluster_flows import spread_item
from tests.support.ledger_tasks import run
task = {"run": run, "item": spread_item}[sys.argv[1]]
print(json.dumps([task.enqueue(json.loads(job)) for job in sys.argv[2:]]))
"""

_STATE = "import sys; from pipeline.celery_app import get_app; print(get_app().AsyncResult(sys.argv[1]).state)"


def _env(cluster: Cluster, ledger: RedisServer) -> dict[str, str]:
    """A cluster URL and no RESULT_BACKEND_URL: results go to the cluster."""
    return {"REDIS_URL": cluster.url(), "TEST_LEDGER_URL": ledger.url, **SHORT_LEASE}


def _pipeline(env: dict[str, str], *argv: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    """`pipeline ARGV` on the cluster, which must exit with `code`."""
    done = run_python(env, "-c", _PIPELINE, *argv)
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _json(env: dict[str, str], *argv: str) -> Any:
    return json.loads(_pipeline(env, *argv, "--json").stdout)


def _enqueue(env: dict[str, str], *jobs: dict[str, Any], task: str = "run") -> list[str]:
    """Jobs enqueued by the pipeline's producer, `test.run` on `default` (or `task="item"`: `test.spread_item` on
    ITEMS, a queue of its own): their ids."""
    done = run_python(env, "-c", _ENQUEUE, task, *map(json.dumps, jobs))
    assert done.returncode == 0, done.stderr[-3000:]
    ids: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return ids


def _celery_state(env: dict[str, str], task_id: str) -> str:
    """`AsyncResult(task_id).state`, read from the cluster by a process of its own."""
    done = run_python(env, "-c", _STATE, task_id)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _events(ledger: RedisServer, key: str) -> list[str]:
    return [json.loads(r)["event"] for r in ledger.client().lrange(f"test:run:{key}", 0, -1)]


def _two_leases_from(since: float) -> None:
    wait_for(lambda: time.time() >= since + 2 * SHORT_LEASE_S, 6 * SHORT_LEASE_S, 0.2, what="two leases past")


def _assert_cancelled(env: dict[str, str], task_id: str) -> None:
    """Read back as `cancelled` (final) by `pipeline status`, as REVOKED by Celery, and not dead-lettered."""
    status = _json(env, "status", task_id)
    assert (status["state"], status["final"]) == ("cancelled", True), status
    assert _celery_state(env, task_id) == "REVOKED"
    assert status["dlq_id"] is None


def _states(status: dict[str, Any]) -> list[str | None]:
    return [step["state"] for step in status["steps"]]


def test_a_waiting_job_cancelled_on_the_cluster_never_runs_and_reads_revoked(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """Cancelled while no worker runs: the tombstone sits in the job's queue's slot (a work queue's, or the queue of
    a typed task's own), and the worker's fetch drops the job unrun, then serves the job queued behind it."""
    env, key, after = _env(redis_cluster, ledger_redis), uuid.uuid4().hex, uuid.uuid4().hex
    job, behind = _enqueue(env, {"key": key}, {"key": after})
    [own] = _enqueue(env, {"key": key}, task="item")
    for task_id, queue in ((job, QUEUE), (own, ITEMS)):
        assert (_json(env, "status", task_id)["state"], _json(env, "status", task_id)["queue"]) == ("queued", queue)
        assert _pipeline(env, "cancel", task_id).stdout.strip() == f"{task_id} cancelled"
        assert redis_cluster.client().exists(keys.cancel(queue, task_id, True)), "the tombstone, in its queue's slot"
    worker = make_worker(f"clo-wait-{key[:6]}", env=env, queues=f"{QUEUE},{ITEMS}", concurrency=1)
    wait_for(lambda: _events(ledger_redis, after) == ["start", "finish"], 60, 0.2, what="the job queued behind")
    for line in (f"job test.run[{job}] was cancelled", f"job test.spread_item[{own}] was cancelled"):
        wait_for(lambda line=line: f"{line}: dropped unrun" in worker.log(), 30, 0.2, what="each job dropped")
    _two_leases_from(time.time())
    assert _events(ledger_redis, key) == [], "the cancelled job never ran"
    assert ledger_redis.client().llen(f"test:ledger:{key}:item") == 0, "nor did the one on a queue of its own"
    _assert_cancelled(env, job)
    _assert_cancelled(env, own)
    assert _json(env, "status", behind)["state"] == "succeeded"
    assert redis_cluster.client().hlen(keys.unacked(QUEUE, True)) == 0


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_running_job_cancelled_on_the_cluster_is_stopped_and_its_worker_serves_the_next(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, pool: str
) -> None:
    """As on a single Redis (`test_cancel.py`): the cancel's PUBLISH reaches the worker running the job, which stops
    it (prefork: its pool process is terminated; solo: `JobCancelled` is raised in it) and takes the next job. The
    job stays cancelled, never finishing, even after its lease would have lapsed."""
    env, key, after = _env(redis_cluster, ledger_redis), uuid.uuid4().hex, uuid.uuid4().hex
    worker = make_worker(f"clo-run-{pool}-{key[:6]}", env=env, queues=QUEUE, concurrency=1, pool=pool)
    [job] = _enqueue(env, {"key": key, "ends": "release"})  # runs until released
    wait_for(lambda: _events(ledger_redis, key) == ["start"], 60, 0.1, what="the job to start")
    runner = json.loads(ledger_redis.client().lindex(f"test:run:{key}", 0))["pid"]
    _pipeline(env, "cancel", job)
    cancelled_at = time.time()
    if pool == "prefork":
        wait_for(lambda: not alive(runner), 30, 0.1, what="the job's pool process to be terminated")
    else:
        wait_for(lambda: _events(ledger_redis, key) == ["start", "stopped"], 30, 0.1, what="the job to be stopped")
    wait_for(lambda: redis_cluster.client().hlen(keys.unacked(QUEUE, True)) == 0, 30, 0.1, what="its acknowledgement")
    [behind] = _enqueue(env, {"key": after})
    wait_for(lambda: _events(ledger_redis, after) == ["start", "finish"], 60, 0.2, what="the next job")
    ledger_redis.client().set(f"test:release:{key}", 1)
    _two_leases_from(cancelled_at)
    assert _events(ledger_redis, key) == (["start"] if pool == "prefork" else ["start", "stopped"])
    _assert_cancelled(env, job)
    if pool == "solo":
        ran = json.loads(ledger_redis.client().lindex(f"test:run:{after}", 0))["pid"]
        assert ran == runner == worker.pid, "the same process goes on"
    assert _json(env, "status", behind)["state"] == "succeeded"


def test_a_running_job_whose_cancel_message_was_missed_is_stopped_by_the_workers_recheck(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """A cancel whose PUBLISH the worker did not hear (its connection was down then) leaves the job's tombstone, in
    its queue's slot: the worker's listener reads the tombstones of the jobs it holds (on a cluster each queue's
    delivery records, in its slot) every RECHECK_S, and stops the job."""
    env, key, after = _env(redis_cluster, ledger_redis), uuid.uuid4().hex, uuid.uuid4().hex
    make_worker(f"clo-missed-{key[:6]}", env=env, queues=QUEUE, concurrency=1, pool="solo")
    [job] = _enqueue(env, {"key": key, "ends": "release"})
    wait_for(lambda: _events(ledger_redis, key) == ["start"], 60, 0.1, what="the job to start")
    redis_cluster.client().set(keys.cancel(QUEUE, job, True), "1", ex=600)  # what a cancel leaves, unheard
    wait_for(lambda: _events(ledger_redis, key) == ["start", "stopped"], 60, 0.2, what="the recheck to stop the job")
    wait_for(lambda: redis_cluster.client().hlen(keys.unacked(QUEUE, True)) == 0, 30, 0.1, what="its acknowledgement")
    _enqueue(env, {"key": after})
    wait_for(lambda: _events(ledger_redis, after) == ["start", "finish"], 60, 0.2, what="the next job")
    assert _json(env, "status", job)["state"] == "cancelled"


def test_a_flow_cancelled_while_its_first_step_runs_queues_nothing_after_it(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """`pipeline flow status` shows each step as it is; `pipeline flow cancel` stops the running step, and the steps
    after it (on queues of two other masters) are never queued nor run."""
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    make_worker(f"clo-fcancel-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    flow_id = _start(env, key)
    wait_for(lambda: _events(ledger_redis, key) == ["start"], 60, 0.1, what="the first step to start")
    running = _json(env, "flow", "status", flow_id)
    assert (running["state"], running["final"]) == ("running", False), running
    assert _states(running) == ["queued", None, None], running["steps"]
    assert [s["waiting_for"] for s in running["steps"]] == [[], ["top"], ["items"]]
    lines = [line.split()[:4] for line in _pipeline(env, "flow", "status", flow_id).stdout.splitlines()]
    assert lines[5][:2] == ["top", "queued"] and lines[6] == ["items", "(each)", "waiting", "for"], lines

    assert _pipeline(env, "flow", "cancel", flow_id).stdout.strip() == f"{flow_id} cancelled"
    cancelled_at = time.time()
    runner = json.loads(ledger_redis.client().lindex(f"test:run:{key}", 0))["pid"]
    wait_for(lambda: not alive(runner), 30, 0.1, what="the first step's pool process to be terminated")
    ledger_redis.client().set(f"test:release:{key}", 1)
    _two_leases_from(cancelled_at)
    runs = _runs(ledger_redis, key)
    assert (runs["items"], runs["end"]) == ([], []), "no step after the cancel ran"
    client = redis_cluster.client()
    assert sum(client.llen(level) for q in (ITEMS, ENDS) for level in keys.levels(q, True)) == 0, "nor was queued"
    done = _json(env, "flow", "status", flow_id)
    assert (done["state"], done["final"]) == ("cancelled", True)
    assert _states(done) == ["cancelled", None, None], done["steps"]
    _assert_cancelled(env, done["steps"][0]["items"][0]["id"])
    again = _pipeline(env, "flow", "cancel", flow_id, "--json", code=1)
    assert "nothing to cancel" in json.loads(again.stdout)["error"]


def test_a_flow_cancelled_over_http_while_its_fan_out_waits_on_another_master_drops_its_items_unrun(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, work_dir: Path
) -> None:
    """`GET /flows/{id}` shows each step's state; `POST /flows/{id}/cancel` cancels the fan-out's jobs waiting on
    their queue (its own slot, on another master than the flow's first step): the worker's fetch drops each unrun, and
    the join is never queued. The items' queue is the task's own (no work queue): `POST /queues/{name}/pause` holds
    it (its flag in its slot) and `GET /queues` shows it paused with its depth until `resume`."""
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    ledger_redis.client().set(f"test:release:{key}", 1)
    worker = make_worker(f"clo-hcancel-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    api = ApiServer(f"clo-{key[-6:]}", work_dir / "logs", env, app=TEST_APP).start()
    try:
        with api.client() as http:
            paused = http.post(f"/queues/{ITEMS}/pause")
            assert paused.status_code == 200 and paused.json() == {"name": ITEMS, "paused": True, "changed": True}
            assert redis_cluster.client().exists(keys.paused(ITEMS, True)), "its flag in its slot"
            started = http.post("/flows/test_spread", json={"key": key, "n": 3})
            assert started.status_code in (200, 201, 202), started.text
            flow_id = started.json()["id"]

            def fanned_out() -> bool:
                status = http.get(f"/flows/{flow_id}").json()
                return bool(_states(status) == ["succeeded", "queued", None])

            wait_for(fanned_out, 60, 0.2, what="the first step done and the fan-out queued")
            waiting = http.get(f"/flows/{flow_id}").json()
            assert waiting["steps"][1]["counts"] == {"queued": 3} and waiting["steps"][2]["waiting_for"] == ["items"]
            items = [job["id"] for job in waiting["steps"][1]["items"]]

            cancelled = http.post(f"/flows/{flow_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert (cancelled.json()["state"], cancelled.json()["final"]) == ("cancelled", True)
            assert _states(cancelled.json()) == ["succeeded", "cancelled", None]
            tombstones = [keys.cancel(ITEMS, job, True) for job in items]
            assert all(redis_cluster.client().exists(t) for t in tombstones), "in the items' queue's slot"
            shown = {q["name"]: q for q in http.get("/queues").json()["queues"]}
            assert (shown[ITEMS]["paused"], shown[ITEMS]["depth"]) == (True, 3), shown.get(ITEMS)
            assert http.post(f"/queues/{ITEMS}/resume").json() == {"name": ITEMS, "paused": False, "changed": True}
            for job in items:
                line = f"job test.spread_item[{job}] was cancelled: dropped unrun"
                wait_for(lambda line=line: line in worker.log(), 60, 0.2, what="the worker to drop each item")
            _two_leases_from(time.time())
            runs = _runs(ledger_redis, key)
            assert (len(runs["top"]), runs["items"], runs["end"]) == (1, [], []), runs
            assert sum(redis_cluster.client().llen(level) for level in keys.levels(ENDS, True)) == 0
            done = http.get(f"/flows/{flow_id}").json()
            assert done["state"] == "cancelled" and done["steps"][1]["counts"] == {"cancelled": 3}
            assert _states(done) == ["succeeded", "cancelled", None]
            assert http.post(f"/flows/{flow_id}/cancel").status_code == 409
    finally:
        redis_cluster.client().delete(keys.paused(ITEMS, True))
        api.stop()


def test_a_dead_lettered_fan_out_item_replayed_runs_once_and_the_flow_runs_to_its_end(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """Item 1 fails for good: it is dead-lettered and the flow is failed at `items` (`pipeline flow status`: each
    step's state, the items' counts). `pipeline dlq replay` of its entry runs it once more, and the join runs once."""
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    ledger = ledger_redis.client()
    ledger.set(f"test:release:{key}", 1)
    ledger.set(f"test:flag:{key}:item:1", 1)
    make_worker(f"clo-replay-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    flow_id = _start(env, key)
    wait_for(lambda: _json(env, "flow", "status", flow_id)["state"] == "failed", 90, 0.5, what="the flow to fail")
    failed = _json(env, "flow", "status", flow_id)
    assert (failed["failed_step"], failed["final"]) == ("items", True)
    assert _states(failed) == ["succeeded", "dead_lettered", None], failed["steps"]
    assert failed["steps"][1]["counts"] == {"succeeded": 2, "dead_lettered": 1}
    item = failed["steps"][1]["items"][1]
    assert (item["node"], item["state"]) == ("items[1]", "dead_lettered")
    [entry] = _json(env, "dlq", "list")
    assert (entry["task_id"], entry["flow"]) == (item["id"], f"test_spread {flow_id} items[1]")

    ledger.delete(f"test:flag:{key}:item:1")
    replayed = _json(env, "dlq", "replay", entry["id"])
    [new] = replayed["replayed"]
    wait_for(lambda: _json(env, "flow", "status", flow_id)["state"] == "succeeded", 90, 0.5, what="the flow's end")
    last = max(r["t"] for runs in _runs(ledger_redis, key).values() for r in runs)
    _two_leases_from(last)
    runs = _runs(ledger_redis, key)
    assert len(runs["top"]) == 1, runs["top"]
    assert sorted(r["i"] for r in runs["items"]) == [0, 1, 1, 2], "each item once, item 1 again when replayed"
    assert [r["task_id"] for r in runs["items"] if r["i"] == 1] == [item["id"], new["new_task_id"]]
    assert [r["i"] for r in runs["end"]] == [3], "the join once, with every item's result"
    done = _json(env, "flow", "status", flow_id)
    assert _states(done) == ["succeeded", "succeeded", "succeeded"], done["steps"]
    assert done["steps"][1]["items"][1]["id"] == new["new_task_id"]
    assert _json(env, "dlq", "list") == []
