"""Flows on a Redis Cluster: a flow whose steps run on queues served by three different masters runs to its end,
each step once, and a hand-off cut short between the flow's call and the step's enqueue (its worker, or the process
starting the flow, SIGKILLed there) is finished by the reconciler, the step queued once.

A real 3+3 cluster (`redis_cluster`), `celery worker` subprocesses on the cluster URL, the flow `test_spread`
(`tests.support.cluster_flows`): `top` on `default`, a fan-out of 3 items on ITEMS, their join on ENDS. Each run is
counted where its side effect lands, the ledger (a redis-server of its own, which also holds the results:
RESULT_BACKEND_URL), two leases after the last one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from redis.cluster import key_slot

from pipeline.constants import FLOW_HANDOFFS_KEY
from pipeline.queues import jobkeys, keys
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S
from tests.support.cluster import Cluster
from tests.support.cluster_flows import ENDS, ITEMS
from tests.support.procs import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.faults

QUEUES = ("default", ITEMS, ENDS)
ITEM_COUNT = 3

_START = """
import json, sys
from pipeline.flows import start
from tests.support import cluster_flows  # noqa: F401  # declares test_spread
key, n = sys.argv[1], int(sys.argv[2])
print(json.dumps({"id": start("test_spread", {"key": key, "n": n}, idempotency_key=sys.argv[3] or None)}))
"""


_START_AND_DIE = """
import os, signal, sys
from pipeline.flows import handoff, start
from tests.support import cluster_flows  # noqa: F401  # declares test_spread
def die(flow_id, claimed):
    print(flow_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
handoff.CLAIMED.append(die)
start("test_spread", {"key": sys.argv[1], "n": int(sys.argv[2])})
"""


_SEND_TWICE = """
import json, sys, time, uuid
from pipeline.flows import handoff, launch
from pipeline.producer.client import producer_redis
from tests.support import cluster_flows
flow_id = str(uuid.uuid4())
step = cluster_flows.spread.steps["top"]
offer = launch.queued(cluster_flows.spread, flow_id, step, [cluster_flows.SpreadInput(key=sys.argv[1])], time.time())
sent = [handoff.send(producer_redis(), flow_id, offer) for _ in range(2)]
print(json.dumps({"sent": sent, "ids": offer.ids}))
"""


def _env(cluster: Cluster, ledger: RedisServer) -> dict[str, str]:
    return {"REDIS_URL": cluster.url(), "RESULT_BACKEND_URL": ledger.url, "TEST_LEDGER_URL": ledger.url, **SHORT_LEASE}


def _start(env: dict[str, str], key: str, idempotency_key: str = "") -> str:
    """`start("test_spread", ...)` in a process of its own on the cluster: the new flow's id (with an
    `idempotency_key` an earlier start claimed: that start's)."""
    done = subprocess.run(
        [sys.executable, "-c", _START, key, str(ITEM_COUNT), idempotency_key],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    flow_id: str = json.loads(done.stdout.strip().splitlines()[-1])["id"]
    return flow_id


def _flow(cluster: Cluster, flow_id: str) -> dict[str, str]:
    raw = cluster.client().hgetall(f"pipeline:flow:{{{flow_id}}}")
    return {k.decode(): v.decode() for k, v in raw.items()}


def _runs(ledger: RedisServer, key: str) -> dict[str, list[dict[str, Any]]]:
    """What each step's jobs recorded: `top`'s starts, each item's run, the join's run."""
    client = ledger.client()
    starts = [r for r in map(json.loads, client.lrange(f"test:run:{key}", 0, -1)) if r["event"] == "start"]
    items = [json.loads(r) for r in client.lrange(f"test:ledger:{key}:item", 0, -1)]
    ends = [json.loads(r) for r in client.lrange(f"test:ledger:{key}:end", 0, -1)]
    return {"top": starts, "items": items, "end": ends}


def _each_step_ran_once(cluster: Cluster, ledger: RedisServer, key: str, flow_id: str) -> None:
    """The flow succeeded; two leases after its last run, each of its jobs had run once."""
    wait_for(lambda: _flow(cluster, flow_id).get("state") == "succeeded", 120, 0.3, what="the flow to succeed")
    last = max(r["t"] for runs in _runs(ledger, key).values() for r in runs)
    wait_for(lambda: time.time() >= last + 2 * SHORT_LEASE_S, 6 * SHORT_LEASE_S, 0.2, what="two leases past the last")
    runs = _runs(ledger, key)
    assert len(runs["top"]) == 1, runs["top"]
    assert sorted(r["i"] for r in runs["items"]) == list(range(ITEM_COUNT)), runs["items"]
    assert [r["i"] for r in runs["end"]] == [ITEM_COUNT], runs["end"]
    wait_for(
        lambda: cluster.client().zscore(FLOW_HANDOFFS_KEY, flow_id) is None,
        30,
        0.3,
        what="the flow off the hand-offs set",
    )


def test_a_flow_whose_steps_run_on_three_masters_runs_each_step_once(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    masters = {redis_cluster.master_of(key_slot(q.encode())).port for q in QUEUES}
    assert len(masters) == 3, "each step's queue on a master of its own"
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    ledger_redis.client().set(f"test:release:{key}", 1)
    make_worker(f"cl-flow-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    flow_id = _start(env, key, idempotency_key=key)
    assert _start(env, key, idempotency_key=key) == flow_id, "a second start with the key: the first flow"
    _each_step_ran_once(redis_cluster, ledger_redis, key, flow_id)
    assert redis_cluster.master_of(key_slot(flow_id.encode())).port in masters


def test_a_worker_killed_between_the_flows_call_and_the_enqueue_leaves_the_step_to_the_reconciler(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    first = make_worker(f"cl-cut-{key[-6:]}", env=env, queues="default", concurrency=1, pool="solo")
    flow_id = _start(env, key)
    ledger = ledger_redis.client()
    ledger.set(f"test:crash-handoff:{flow_id}", 1)
    ledger.set(f"test:release:{key}", 1)  # `top` finishes; its hand-off claims `items`, and its worker dies there
    assert first.wait(120) == -signal.SIGKILL, first.log()[-3000:]

    flow = _flow(redis_cluster, flow_id)
    assert "on:items" in flow and flow["n:items"] == str(ITEM_COUNT), "the fan-out step is claimed"
    waiting = [redis_cluster.client().llen(level) for level in keys.levels(ITEMS, True)]
    assert sum(waiting) == 0, "and none of its jobs is queued"

    second = make_worker(f"cl-rec-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    _each_step_ran_once(redis_cluster, ledger_redis, key, flow_id)
    assert "step items was claimed and not queued" in second.log(), second.log()[-3000:]


def test_a_producer_killed_between_the_flows_call_and_the_first_steps_enqueue_leaves_it_to_the_reconciler(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    env, key = _env(redis_cluster, ledger_redis), f"spread-{uuid.uuid4().hex[:8]}"
    ledger_redis.client().set(f"test:release:{key}", 1)
    done = subprocess.run(
        [sys.executable, "-c", _START_AND_DIE, key, str(ITEM_COUNT)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    flow_id = done.stdout.strip().splitlines()[-1]
    assert "on:top" in _flow(redis_cluster, flow_id), "the first step is claimed"
    assert sum(redis_cluster.client().llen(level) for level in keys.levels("default", True)) == 0, "and not queued"

    worker = make_worker(f"cl-start-{key[-6:]}", env=env, queues=",".join(QUEUES), concurrency=2)
    _each_step_ran_once(redis_cluster, ledger_redis, key, flow_id)
    assert "step top was claimed and not queued" in worker.log(), worker.log()[-3000:]


def test_a_step_enqueued_twice_under_its_claim_is_queued_once_and_keeps_its_record(
    redis_cluster: Cluster, ledger_redis: RedisServer
) -> None:
    """A hand-off and the reconciler enqueueing the same step (its claimed job ids): the second writes nothing, and
    does not delete the job's record the first wrote (a producer that loses an idempotency key to another job
    deletes the records it wrote first)."""
    env = {**os.environ, **_env(redis_cluster, ledger_redis)}
    done = subprocess.run(
        [sys.executable, "-c", _SEND_TWICE, "twice"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sent"] == [True, False]
    [job] = out["ids"]
    client = redis_cluster.client()
    waiting = [
        json.loads(m)["headers"]["id"] for level in keys.levels("default", True) for m in client.lrange(level, 0, -1)
    ]
    assert waiting == [job], "queued once"
    assert client.exists(jobkeys.record(job, cluster=True)) == 1, "its record kept"
