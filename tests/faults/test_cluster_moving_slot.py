"""A worker on a Redis Cluster while one of its queues' slot is moving: the slot held split between two masters
(IMPORTING on the target, MIGRATING on the source, some of the queue's keys migrated), so every script on that
queue (a fetch, an acknowledgement, a renewal) gets TRYAGAIN. The worker goes on with its other queue (on another
master) without reconnecting: each of its jobs runs, jobs longer than a lease among them (their leases renewed
meanwhile). The moving queue's acknowledgements that got TRYAGAIN are applied once the slot has moved, and its jobs
queued during the move are fetched then: every job of both queues runs once, counted at the side effect two leases
after the last finish.

A cluster of this module's own (3 masters, 3 replicas: `tests.support.cluster`), since the test moves a slot; a
`celery worker` subprocess (prefork) on both queues; Celery's publish from a process of its own.
"""

from __future__ import annotations

import collections
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import key_slot
from redis.exceptions import ClusterError, TryAgainError

from pipeline.constants import WORK_QUEUES
from pipeline.delivery import moving
from pipeline.queues import keys
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, done, starts
from tests.support.cluster import Cluster, Move
from tests.support.cluster_send import send
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults

#: What Celery's consumer logs when its connection to the broker is lost and it reconnects.
RECONNECT = "Connection to broker lost"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = Cluster(Path(tmp_path_factory.mktemp("moving-cluster"))).start()
    yield started
    started.stop()


def _queues(cluster: Cluster) -> tuple[str, str, int]:
    """A queue to move, a steady queue on another master, and the port of a third master to move the first to."""
    master = {queue: cluster.master_of(key_slot(queue.encode())).port for queue in WORK_QUEUES}
    moving, steady = next((a, b) for a in WORK_QUEUES for b in WORK_QUEUES if master[a] != master[b])
    masters = {m.port for m in cluster.members() if m.master and m.alive}
    (third,) = masters - {master[moving], master[steady]}
    return moving, steady, third


def _tryagain(move: Move, queue: str) -> bool:
    """Whether a script naming the queue's lease records is refused with TRYAGAIN while the slot is split (as the
    worker's fetch, acknowledgement and renewal are): asked on the target, after the source's ASK."""
    names = [keys.unacked_index(queue, True), keys.lease(queue, True)]
    client = redis.Redis(host="127.0.0.1", port=move.target.port, socket_timeout=5, single_connection_client=True)
    try:
        client.execute_command("ASKING")
        client.execute_command("EVAL", "return 1", len(names), *names)
    except TryAgainError:
        return True
    finally:
        client.close()
    return False


def _ledger_now(ledger: RedisServer) -> float:
    seconds, micros = ledger.client().time()
    return seconds + micros / 1e6


def _past_two_leases(ledger: RedisServer, key: str) -> None:
    """Wait until 2 x LEASE_SECONDS after the last completion's record, on the ledger's clock."""
    last = max(json.loads(x)["t"] for x in ledger.client().lrange(f"test:ledger:{key}", 0, -1))
    wait_for(lambda: _ledger_now(ledger) >= last + 2 * SHORT_LEASE_S, 6 * SHORT_LEASE_S, 0.2, what="two leases past")


def test_a_queue_whose_slot_is_moving_holds_up_no_other_queue_and_its_jobs_run_once_after_the_move(
    cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    moving, steady, third = _queues(cluster)
    key = uuid.uuid4().hex
    env = {"REDIS_URL": cluster.url(), "RESULT_BACKEND_URL": ledger_redis.url, "TEST_LEDGER_URL": ledger_redis.url}
    env.update(SHORT_LEASE)
    worker = make_worker(f"cl-moving-{key[:6]}", env=env, queues=f"{moving},{steady}", concurrency=4)

    # Two jobs of the moving queue running as its slot starts moving: they finish while it is split.
    running = send(env, moving, key, 2, 1.5)["ids"]
    wait_for(lambda: len(starts(ledger_redis, key)) == 2, 60, 0.05, what="the moving queue's two jobs to start")
    move = cluster.move(key_slot(moving.encode()), third)
    move.migrate([keys.lease(moving, True)])  # its leases on the target, the rest of its keys on the source
    split = _ledger_now(ledger_redis)
    assert _tryagain(move, moving), "the moving queue's scripts are refused with TRYAGAIN while its slot is split"

    # Jobs queued on both queues while the slot is split; the steady queue's longer than a lease among them.
    queued = send(env, moving, key, 6, 0)["ids"]
    short = send(env, steady, key, 8, 0)["ids"]
    long = send(env, steady, key, 3, 2 * SHORT_LEASE_S)["ids"]
    wait_for(lambda: set(short + long) <= set(done(ledger_redis, key)), 120, 0.2, what="the steady queue's jobs")
    assert _tryagain(move, moving), "the slot is still split"
    finished = {job for job, _ in done(ledger_redis, key).items()}
    print(f"while split: {len(finished & set(running))} of the moving queue's running jobs finished")
    assert set(running) <= finished, "the moving queue's running jobs finished while its slot was split"
    assert not set(queued) & {s["task_id"] for s in starts(ledger_redis, key)}, "nothing fetched from the split slot"
    assert RECONNECT not in worker.log(), worker.log()[-4000:]

    move.finish()
    wait_for(lambda: cluster.master_of(move.slot).port == third, 20, 0.1, what="every node to name the new owner")
    print(f"slot {move.slot} split for {_ledger_now(ledger_redis) - split:.1f} s; {move.moved} key(s) moved")
    jobs = running + queued + short + long
    wait_for(lambda: set(jobs) <= set(done(ledger_redis, key)), 120, 0.2, what="every job to finish")
    _past_two_leases(ledger_redis, key)
    ran = collections.Counter(s["task_id"] for s in starts(ledger_redis, key))
    assert done(ledger_redis, key) == collections.Counter(dict.fromkeys(jobs, 1)), "each job finished once"
    assert ran == collections.Counter(dict.fromkeys(jobs, 1)), "each job started once"
    client = cluster.client()
    try:
        for queue in (moving, steady):
            assert client.hlen(keys.unacked(queue, True)) == 0 and client.hlen(keys.lease(queue, True)) == 0
    finally:
        client.close()
    assert RECONNECT not in worker.log(), worker.log()[-4000:]


def _refused(move: Move) -> int:
    """How many calls the two masters of `move` refused with TRYAGAIN since their last CONFIG RESETSTAT."""
    stats = [node.client().info("errorstats").get("errorstat_TRYAGAIN", {}) for node in (move.source, move.target)]
    return sum(int(stat.get("count", 0)) for stat in stats)


@pytest.mark.parity  # redis-py's request TTL, read from the client instance (`pipeline.delivery.ENTRIES`)
def test_a_worker_channels_client_gives_up_on_a_moving_slot_after_its_tries(cluster: Cluster) -> None:
    """redis-py's cluster client retries a call refused with TRYAGAIN up to its `RedisClusterRequestTTL`, read from
    the instance: the worker channel's client (`moving.impatient`) is refused TRIES times at most, a default client
    more often, each then raising what `moving.is_moving` names."""
    queue = WORK_QUEUES[0]
    slot = key_slot(queue.encode())
    names = [keys.unacked_index(queue, True), keys.lease(queue, True)]
    client = cluster.client()
    client.zadd(names[0], {"tag": 1})
    client.hset(names[1], "tag", "owner")
    source = cluster.master_of(slot).port
    move = cluster.move(slot, min({m.port for m in cluster.members() if m.master and m.alive} - {source}))
    try:
        move.migrate([names[1]])  # the lease on the target, the index on the source: split
        refused = []
        for caller in (moving.impatient(cluster.client()), cluster.client()):
            for node in (move.source, move.target):
                node.client().config_resetstat()
            with pytest.raises(ClusterError) as raised:
                caller.eval("return 1", len(names), *names)
            assert moving.is_moving(raised.value)
            refused.append(_refused(move))
            caller.close()
        assert 1 <= refused[0] <= moving.TRIES < refused[1], refused
    finally:
        move.finish()
        client.delete(*names)
        client.close()
