"""The producer's writes on a Redis Cluster (`tests.support.cluster`): jobs land in their queue's slot on the master
serving it, with their wake-up marker, recent-jobs entry and record; parked jobs, releases, cancel tombstones, the
dead-letter queue and pauses use the queue's (or the dead-letter list's) slot. No worker consumes a cluster here:
each test asserts on what Redis holds, on the node that holds it.

The producing runs in a child process whose REDIS_URL names the cluster (settings are read once per process); it
prints what it did as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import redis
from redis.cluster import key_slot

from pipeline.queues import jobkeys, keys
from tests.support.cluster import Cluster
from tests.support.procs import ROOT

_PREAMBLE = """
import json, sys, time
from pipeline.task import load_task_modules
tasks = load_task_modules()
probe, webhook = tasks["probe"], tasks["webhook"]
out = {}
"""

_ENQUEUE = """
out["one"] = probe.enqueue({"message": "one"})
out["many"] = webhook.enqueue_many(
    [{"url": "https://example.com/a", "event": "e", "payload": {}}] * 2, priority=3
)
out["grouped"] = probe.enqueue({"message": "g"}, group="tenant-1")
from pipeline.broker import broker_redis
def records():
    with broker_redis() as client:
        return sum(1 for _ in client.scan_iter(match="pipeline:job:*", count=1000))
out["keyed"] = [probe.enqueue({"message": "k"}, idempotency_key=sys.argv[1])]
before = records()
out["keyed"].append(probe.enqueue({"message": "k"}, idempotency_key=sys.argv[1]))
out["records_added_by_repeat"], out["records_before"] = records() - before, before
from pipeline.records import forget_accepted, record_accepted
for task_id in ("accepted-kept", "accepted-forgotten"):
    record_accepted(task_id, "pipeline.probe", queue="pdf")
forget_accepted("accepted-forgotten", "pdf")
try:
    probe.enqueue({"message": "x" * 5000})
except Exception as exc:
    out["invalid"] = type(exc).__name__
"""

_DELAYED = """
from pipeline.control.cancel import _tombstone
from pipeline.scheduling.delayed import release_due
out["due"] = probe.enqueue({"message": "later"}, countdown=600)
out["dropped"] = probe.enqueue({"message": "dropped"}, countdown=600)
out["queued"] = probe.enqueue({"message": "queued"})
out["soon"] = probe.enqueue({"message": "soon"}, countdown=1)  # within DELAYED_RELEASE_AHEAD: queued at once
from pipeline.publish import parked_due, parked_stats
out["parked_in"] = parked_due(out["due"]) - time.time()
out["parked_count"] = parked_stats().count
out["parked_dropped"] = _tombstone(out["dropped"], "default")
out["queued_parked"] = _tombstone(out["queued"], "default")
out["released"] = release_due(now=time.time() + 1200)
"""

_DLQ = """
from pipeline.dlq import admin
from pipeline.dlq.envelope import DeadLetter, publish
entry = DeadLetter(reason="failed", task_name="pipeline.probe", queue="default", args=[{"message": "dl"}],
                   exception_type="RuntimeError", exception_message="boom")
out["entry"] = publish(entry)
out["listed"] = [e.id for e in admin.list_entries()]
out["replayed"] = admin.replay(out["entry"])
out["after_replay"] = [e.id for e in admin.list_entries()]
publish(entry.model_copy(update={"id": entry.id + "-2"}))
out["purged"] = admin.purge()
out["after_purge"] = [e.id for e in admin.list_entries()]
"""

_PAUSE = """
from pipeline.scheduling import pause
out["paused"] = [pause.pause("email"), pause.pause("email"), pause.is_paused("email")]
out["resumed"] = [pause.resume("email"), pause.resume("email"), pause.is_paused("email")]
out["pause_again"] = pause.pause("pdf")
"""


_DURABLE = """
from pipeline.scheduling import pause
out["one"] = probe.enqueue({"message": "durable"})
out["keyed"] = [probe.enqueue({"message": "k"}, idempotency_key=sys.argv[1]) for _ in range(2)]
out["parked"] = probe.enqueue({"message": "later"}, countdown=600)
out["paused"] = pause.pause("transcode")
out["resumed"] = pause.resume("transcode")
"""


def _produce(cluster: Cluster, body: str, *argv: str, replicas: int = 0) -> dict[str, Any]:
    env = {**os.environ, "REDIS_URL": cluster.url(), "REDIS_WAIT_REPLICAS": str(replicas)}
    code = _PREAMBLE + body + "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reply: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return reply


def _on_master(cluster: Cluster, key: str) -> redis.Redis:
    """A plain client on the master serving `key`'s slot (it answers MOVED for any other slot)."""
    return cluster.master_of(key_slot(key.encode())).client()


def _ids(raw: list[bytes]) -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in raw]


def _waiting(node: redis.Redis, queue: str) -> list[str]:
    """The ids of the jobs waiting in any priority list of `queue` (read on the master serving it)."""
    return [task_id for key in keys.levels(queue, cluster=True) for task_id in _ids(node.lrange(key, 0, -1))]


def test_enqueued_jobs_land_in_their_queues_slot_with_marker_index_record_and_idempotency(
    redis_cluster: Cluster,
) -> None:
    out = _produce(redis_cluster, _ENQUEUE, "key-enqueue")
    default, webhooks = _on_master(redis_cluster, "default"), _on_master(redis_cluster, "webhooks")
    assert default is not webhooks
    assert redis_cluster.master_of(key_slot(b"default")) is not redis_cluster.master_of(key_slot(b"webhooks"))
    waiting = _waiting(default, "default")
    assert out["one"] in waiting and out["keyed"][0] in waiting
    assert out["keyed"][0] == out["keyed"][1], "the same idempotency key gives the first job's id"
    assert out["records_added_by_repeat"] == 0, "the repeat's record, written before the call, is dropped"
    assert out["records_before"] >= 5, "the scan counts the records on every master"
    assert waiting.count(out["keyed"][0]) == 1, "one job for the key"
    claim = keys.idempotency("default", "pipeline.probe", "key-enqueue", cluster=True)
    assert default.get(claim) == out["keyed"][0].encode()
    assert _ids(webhooks.lrange(keys.level("webhooks", 3, cluster=True), 0, -1)) == out["many"][::-1]
    assert webhooks.llen(keys.wake("webhooks", cluster=True)) >= 2
    assert default.llen(keys.wake("default", cluster=True)) >= 1
    recent = {m.decode() for m in default.zrange(keys.recent("default", cluster=True), 0, -1)}
    assert {out["one"], out["grouped"], out["keyed"][0]} <= recent
    lists = [k for k in keys.levels("default", cluster=True) if default.hget(keys.group_count("default", True), k)]
    assert len(lists) == 1, "the grouped job's list counts one grouped job"
    group_list = keys.group_jobs("default", lists[0], "tenant-1", cluster=True)
    assert _ids(default.lrange(group_list, 0, -1)) == [out["grouped"]]
    assert default.lrange(keys.group_ring("default", lists[0], cluster=True), 0, -1) == [b"tenant-1"]
    client = redis_cluster.client()
    for task_id in [out["one"], out["grouped"], out["keyed"][0], *out["many"]]:
        record = client.get(jobkeys.record(task_id, True))
        assert record is not None and json.loads(record)["task"] in ("pipeline.probe", "webhooks.deliver")
    assert out["invalid"] == "PayloadInvalid"
    pdf_recent = _on_master(redis_cluster, "pdf").zrange(keys.recent("pdf", cluster=True), 0, -1)
    assert b"accepted-kept" in pdf_recent and b"accepted-forgotten" not in pdf_recent
    assert (
        client.get(jobkeys.record("accepted-kept", True)) is not None
        and client.get(jobkeys.record("accepted-forgotten", True)) is None
    )
    assert len(_waiting(default, "default")) == len(waiting), "an invalid payload stores nothing"


def test_a_parked_job_is_released_to_its_queue_and_a_cancelled_one_never_is(redis_cluster: Cluster) -> None:
    out = _produce(redis_cluster, _DELAYED)
    default = _on_master(redis_cluster, "default")
    index, bodies, dests = keys.delayed("default", cluster=True)
    assert out["parked_dropped"] == 1 and out["queued_parked"] == 0
    assert out["released"] >= 1
    waiting = _waiting(default, "default")
    assert 590 < out["parked_in"] <= 600 and out["parked_count"] >= 2, "the parked jobs are read where they are"
    assert out["due"] in waiting and out["queued"] in waiting and out["soon"] in waiting
    assert redis_cluster.client().get(jobkeys.record(out["soon"], True)) is not None
    assert out["dropped"] not in waiting, "a cancelled parked job is never released"
    assert default.zscore(index, out["due"]) is None and default.zscore(index, out["dropped"]) is None
    assert not default.hexists(bodies, out["dropped"]) and not default.hexists(dests, out["dropped"])
    for task_id in (out["dropped"], out["queued"]):
        assert default.get(keys.cancel("default", task_id, cluster=True)) == b"1", "the tombstone is in the slot"


def test_dead_letter_write_list_replay_and_purge_on_the_dead_letter_slot(redis_cluster: Cluster) -> None:
    out = _produce(redis_cluster, _DLQ)
    assert out["entry"] in out["listed"]
    assert out["entry"] not in out["after_replay"]
    assert out["purged"] >= 1 and out["after_purge"] == []
    default = _on_master(redis_cluster, "default")
    assert out["replayed"] in _waiting(default, "default"), "the replay went to the job's queue"
    dead = _on_master(redis_cluster, "dead_letter")
    index, tasks = keys.dlq_index(cluster=True)
    assert key_slot(index.encode()) == key_slot(tasks.encode()) == key_slot(b"dead_letter")
    assert dead.llen("dead_letter") == 0 and dead.hlen(index) == 0


def test_pause_and_resume_keep_a_flag_in_the_queues_slot(redis_cluster: Cluster) -> None:
    out = _produce(redis_cluster, _PAUSE)
    assert out["paused"] == [True, False, True]
    assert out["resumed"] == [True, False, False]
    email, pdf = _on_master(redis_cluster, "email"), _on_master(redis_cluster, "pdf")
    assert not email.exists(keys.paused("email", cluster=True))
    assert email.llen(keys.wake("email", cluster=True)) >= 1, "a resume wakes the queue's idle workers"
    assert out["pause_again"] is True and pdf.get(keys.paused("pdf", cluster=True)) == b"1"
    pdf.delete(keys.paused("pdf", cluster=True))


def test_with_wait_replicas_each_write_is_confirmed_by_the_replica_of_the_master_that_took_it(
    redis_cluster: Cluster,
) -> None:
    out = _produce(redis_cluster, _DURABLE, "key-durable", replicas=1)
    assert out["keyed"][0] == out["keyed"][1] and out["paused"] is True and out["resumed"] is True
    master = redis_cluster.master_of(key_slot(b"default"))
    replica = redis.Redis(port=redis_cluster.replica_of(master).port, single_connection_client=True)
    replica.execute_command("READONLY")  # a replica answers reads of its master's slots on this connection
    # WAIT returned 1 before each call answered: the replica holds the jobs already, read there without waiting.
    waiting = _waiting(replica, "default")
    assert out["one"] in waiting and out["keyed"][0] in waiting
    assert replica.zscore(keys.delayed("default", cluster=True)[0], out["parked"]) is not None
