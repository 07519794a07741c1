"""The test Redis Cluster (`tests.support.cluster`): queues' hash tags spread over its masters, and its failover
helper promotes a master's replica while a cluster client keeps reading and writing the same keys."""

from __future__ import annotations

import uuid

import pytest
import redis
from redis.cluster import key_slot

from pipeline.constants import WORK_QUEUES
from tests.support.cluster import Cluster


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
