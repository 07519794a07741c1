"""The test Redis Cluster (`tests.support.cluster`): queues' hash tags spread over its masters, and its failover
helper promotes a master's replica while a cluster client keeps reading and writing the same keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis
from redis.cluster import key_slot

from pipeline.constants import WORK_QUEUES
from tests.support.cluster import Cluster
from tests.support.procs import ROOT


def _slot_on(cluster: Cluster, key: str) -> int:
    """The slot of `key` as a node of the cluster computes it (CLUSTER KEYSLOT)."""
    return int(cluster.seeds[0].client().execute_command("CLUSTER KEYSLOT", key))


def test_keys_tagged_for_different_queues_land_on_the_master_serving_each_queue(redis_cluster: Cluster) -> None:
    client = redis_cluster.client()
    run = uuid.uuid4().hex[:8]
    keys = {queue: f"pipeline:{{{queue}}}:probe-{run}" for queue in WORK_QUEUES}
    try:
        for queue, key in keys.items():
            client.set(key, queue)
        masters = {}
        for queue, key in keys.items():
            slot = _slot_on(redis_cluster, key)
            assert slot == key_slot(queue.encode()), "the tag's slot is the slot of the queue's own list key"
            master = redis_cluster.master_of(slot)
            assert master.client().get(key) == queue.encode(), f"{key} is on the master of slot {slot}"
            masters[queue] = master.port
        assert len(set(masters.values())) > 1, f"every queue on one master: {masters}"
        # A master refuses a key of a queue it does not serve (MOVED): the keys are where the map says, only there.
        one, other = next((a, b) for a in keys for b in keys if masters[a] != masters[b])
        with pytest.raises(redis.exceptions.MovedError):
            redis_cluster.node(masters[one]).client().get(keys[other])
    finally:
        for key in keys.values():
            client.delete(key)


def test_fail_over_promotes_the_masters_replica_and_a_cluster_client_follows(redis_cluster: Cluster) -> None:
    client = redis_cluster.client()
    key = f"pipeline:{{webhooks}}:failover-{uuid.uuid4().hex[:8]}"
    slot = key_slot(key.encode())
    client.set(key, "before")
    master = redis_cluster.master_of(slot)
    replica = redis_cluster.replica_of(master)
    assert master.client().execute_command("WAIT", 1, 5000) == 1, "the replica holds the write before the kill"
    try:
        promoted = redis_cluster.fail_over(master)
        assert promoted is replica
        assert master.proc is None, "the old master is down"
        assert redis_cluster.master_of(slot) is promoted
        assert promoted.client().execute_command("ROLE")[0] == b"master"
        assert client.get(key) == b"before", "the client follows the new slot map to the promoted replica"
        client.set(key, "after")
        assert promoted.client().get(key) == b"after"
    finally:
        if master.proc is None:
            redis_cluster.restart(master)
        client.delete(key)
    assert redis_cluster.healthy(), "every slot replicated again after the restart"
    assert redis_cluster.replica_of(promoted) is master, "the killed master came back as the new master's replica"


#: Run with REDIS_URL on the cluster: the broker module's three clients, each writing and reading through the slot map.
_CLIENTS = """
import asyncio, json, sys
import redis.asyncio.cluster
from redis.cluster import RedisCluster
from pipeline.broker import async_redis, broker_redis, direct_redis

keys = sys.argv[1:]
direct = direct_redis(5)
direct.set(keys[0], "direct")

async def through_async():
    client = async_redis(5)
    await client.set(keys[1], "async")
    try:
        return type(client) is redis.asyncio.cluster.RedisCluster, (await client.get(keys[0])).decode()
    finally:
        await client.aclose()

is_async_cluster, seen = asyncio.run(through_async())
with broker_redis() as shared:
    shared.set(keys[2], "shared")
    values = [v.decode() for v in shared.mget_nonatomic(keys)]
print(json.dumps({"direct": type(direct) is RedisCluster, "async": is_async_cluster, "seen": seen,
                  "shared": type(shared) is RedisCluster, "values": values}))
"""


def test_the_broker_clients_on_a_cluster_url_are_cluster_clients_that_follow_the_slot_map(
    redis_cluster: Cluster,
) -> None:
    run = uuid.uuid4().hex[:8]
    keys = [f"pipeline:{{{queue}}}:client-{run}" for queue in ("email", "pdf", "webhooks")]
    env = {**os.environ, "REDIS_URL": redis_cluster.url()}
    done = subprocess.run(
        [sys.executable, "-c", _CLIENTS, *keys], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    try:
        assert done.returncode == 0, done.stderr[-2000:]
        reply = json.loads(done.stdout)
        assert reply == {
            "direct": True,
            "async": True,
            "seen": "direct",
            "shared": True,
            "values": ["direct", "async", "shared"],
        }
        for key, value in zip(keys, reply["values"], strict=True):
            master = redis_cluster.master_of(key_slot(key.encode()))
            assert master.client().get(key) == value.encode(), f"{key} on the master serving its slot"
    finally:
        redis_cluster.client().delete(*keys)
