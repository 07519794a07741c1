"""Results stored on the Redis Cluster itself by the workers (RESULT_BACKEND_URL unset): `delay().get()`, typed jobs
read back with `pipeline status`, their records and owner stamps dropped with the SUCCESS, a group and a chord, and
the fence: a state of a worker the result's owner stamp does not name is refused (`pipeline.delivery.stamps`,
`pipeline.compat.clusterresults`).

A real 3+3 cluster (`redis_cluster`), `celery worker` subprocesses, Celery's calls from a process of its own
(`tests.support.cluster_producer`); the ledger Redis only records what the ledger jobs did.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from redis.cluster import key_slot

from pipeline.queues import jobkeys, keys
from tests.faults.ledger import SHORT_LEASE
from tests.integration.test_cluster_jobs import _cli
from tests.support.cluster import Cluster
from tests.support.cluster_send import produce
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults

QUEUE = "default"  # test.ledger's and plain.*'s route


def _env(cluster: Cluster, ledger: RedisServer) -> dict[str, str]:
    """A cluster URL and no RESULT_BACKEND_URL: results go to the cluster."""
    return {"REDIS_URL": cluster.url(), "TEST_LEDGER_URL": ledger.url, **SHORT_LEASE}


def _stored(cluster: Cluster, ids: list[str]) -> bool:
    client = cluster.client()
    return all(client.exists(jobkeys.result(task_id)) for task_id in ids)


def test_delay_get_with_results_on_the_cluster(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cr-get-{key[:6]}", env=env, queues=QUEUE, concurrency=1)
    got = produce(env, "get", QUEUE, key)
    assert got["result"]["key"] == key and got["result"]["attempt"] == 1
    meta = json.loads(redis_cluster.client().get(jobkeys.result(got["id"])))
    assert meta["status"] == "SUCCESS", "stored on the cluster, on the master serving its key"
    assert not redis_cluster.client().exists(jobkeys.stamp(jobkeys.result(got["id"]))), "the stamp went with it"


def test_typed_jobs_store_their_results_on_the_cluster_and_drop_their_records(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    env = _env(redis_cluster, ledger_redis)
    ids = _cli(env, "enqueue-many", "probe", json.dumps([{"message": f"p{i}"} for i in range(8)]))["ids"]
    client = redis_cluster.client()
    records = [jobkeys.record(task_id, True) for task_id in ids]
    assert all(client.exists(record) for record in records), "each job recorded as accepted"
    assert len({redis_cluster.master_of(key_slot(jobkeys.result(i).encode())).port for i in ids}) > 1
    make_worker(f"cr-typed-{ids[0][:6]}", env=env, queues=QUEUE, concurrency=2)
    wait_for(lambda: _stored(redis_cluster, ids), 60, 0.2, what="every job's result on the cluster")
    statuses = {task_id: _cli(env, "status", task_id) for task_id in ids}
    assert {s["state"] for s in statuses.values()} == {"succeeded"}, statuses
    assert [statuses[i]["result"]["message"] for i in ids] == [f"p{n}" for n in range(8)]
    assert not any(client.exists(record) for record in records), "a SUCCESS drops its job's record"
    assert not any(client.exists(jobkeys.stamp(jobkeys.result(i))) for i in ids), "and the result's owner stamp"
    wait_for(lambda: client.hlen(keys.unacked(QUEUE, True)) == 0, 10, 0.1, what="the acknowledgements")


def test_the_worker_stamps_the_result_of_the_delivery_it_takes(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """The stamp is written by the worker's fetch: a job that fails leaves it (only a SUCCESS drops it), naming the
    delivery's tag, the worker's lease owner and the delivery's count, beside the FAILURE in the result's slot. A job
    whose result is ignored (run before it, one job at a time) gets none: nothing would drop it."""
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cr-stamp-{uuid.uuid4().hex[:6]}", env=env, queues=QUEUE, concurrency=1)
    failed = produce(env, "fail", QUEUE, "-")
    assert failed["state"] == "FAILURE"
    stamp = redis_cluster.client().hgetall(jobkeys.stamp(jobkeys.result(failed["id"])))
    assert len(stamp) == 2, stamp
    tag = next(k for k in stamp if not k.endswith(b"#"))
    assert stamp[tag + b"#"] == b"1" and stamp[tag].count(b":") == 2, "tag -> host:pid:incarnation, tag# -> count"
    assert 0 < redis_cluster.client().ttl(jobkeys.stamp(jobkeys.result(failed["id"]))) <= 86400
    client = redis_cluster.client()
    assert client.llen(QUEUE) == 0 and not client.exists(jobkeys.result(failed["ignored"]))
    assert not client.exists(jobkeys.stamp(jobkeys.result(failed["ignored"]))), "no stamp for an ignored result"


def test_a_late_state_of_a_worker_a_peer_took_the_job_from_is_refused_by_the_stamp(
    redis_cluster: Cluster, ledger_redis: RedisServer
) -> None:
    """The fence on a cluster, in the result's slot: the first worker stamped delivery 1 and stored a state; its
    lease lapsed, a peer took delivery 2 and stamped it; the first worker's late stamp and states are refused, the
    peer's stored, and its SUCCESS drops the stamp and the job's record."""
    tag, task_id = uuid.uuid4().hex, uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    client = redis_cluster.client()
    record = jobkeys.record(task_id, True)
    client.set(record, "{}")
    try:
        assert produce(env, "stamp", QUEUE, tag, "first:1:a", task_id, "1") == {"stamped": True}
        assert produce(env, "store", QUEUE, tag, "first:1:a", task_id, "STARTED") == {
            "stored": True,
            "by": "first:1:a",
        }
        assert produce(env, "stamp", QUEUE, tag, "peer:2:b", task_id, "2") == {"stamped": True}
        assert produce(env, "stamp", QUEUE, tag, "first:1:a", task_id, "1") == {"stamped": False}
        assert produce(env, "store", QUEUE, tag, "first:1:a", task_id, "FAILURE") == {
            "stored": False,
            "by": "first:1:a",
        }
        assert produce(env, "store", QUEUE, tag, "first:1:a", task_id) == {"stored": False, "by": "first:1:a"}
        assert client.exists(record), "a refused SUCCESS drops nothing"
        assert produce(env, "store", QUEUE, tag, "peer:2:b", task_id) == {"stored": True, "by": "peer:2:b"}
        assert not client.exists(record) and not client.exists(jobkeys.stamp(jobkeys.result(task_id)))
    finally:
        client.delete(jobkeys.result(task_id), record, jobkeys.stamp(jobkeys.result(task_id)))


def test_a_group_and_a_chord_with_results_on_the_cluster(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """A group's results are read from several masters; a chord's counters share its group id's slot (Celery's
    `on_chord_part_return` script names them all), and its body runs once with every header result."""
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cr-canvas-{uuid.uuid4().hex[:6]}", env=env, queues=QUEUE, concurrency=2)
    assert produce(env, "canvas", QUEUE, "-") == {"group": [0, 2, 4, 6, 8], "chord": 10}
