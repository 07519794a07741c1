"""The names of a queue's keys (`pipeline.queues.keys`): on a Redis Cluster every one of them hashes to the queue's
slot (as a node of the test cluster computes it), so a script over them touches one slot; on a single Redis they are
the names the pipeline and kombu have always used."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from pipeline.constants import (
    DEAD_LETTER_QUEUE,
    DELAYED_KEY,
    GROUP_COUNT_KEY,
    LEASE_KEY,
    PAUSED_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
    WORK_QUEUES,
)
from pipeline.queues import keys
from tests.support.cluster import Cluster

#: The work queues, the DLQ, and names of the shapes users give queues (dots, colons, a Celery reply queue).
QUEUES = (*WORK_QUEUES, DEAD_LETTER_QUEUE, "tenant.eu:reports", "celery", "x")


def test_every_queue_scoped_name_hashes_to_the_queues_slot_on_the_cluster(redis_cluster: Cluster) -> None:
    node = redis_cluster.seeds[0].client()
    slots = {}
    for queue in QUEUES:
        names = keys.every(queue, cluster=True)
        assert len(set(names)) == len(names), f"two kinds share a name for {queue}"
        pipe = node.pipeline(transaction=False)
        for name in names:
            pipe.execute_command("CLUSTER KEYSLOT", name)
        found = dict(zip(names, map(int, pipe.execute()), strict=True))
        slot = int(node.execute_command("CLUSTER KEYSLOT", queue))  # kombu's list key: the queue's own name
        assert {name: s for name, s in found.items() if s != slot} == {}, f"{queue}: names off its slot {slot}"
        assert slot == key_slot(keys.tag(queue).encode())
        slots[queue] = slot
    assert len(set(slots.values())) == len(QUEUES), "the queues land in different slots"


def test_the_cluster_names_carry_the_tag_and_kombus_step_zero_list_keeps_its_name() -> None:
    assert keys.levels("webhooks", cluster=True) == [
        "webhooks",
        "{webhooks}\x06\x163",
        "{webhooks}\x06\x166",
        "{webhooks}\x06\x169",
    ]
    assert keys.lease("webhooks", cluster=True) == "pipeline:{webhooks}:lease"
    assert keys.idempotency("webhooks", "webhooks.deliver", "k", cluster=True) == (
        "pipeline:{webhooks}:enqueue:webhooks.deliver:k"
    )
    for key in keys.levels("webhooks", cluster=True):
        assert keys.queue_of(key, cluster=True) == "webhooks"
    assert keys.queue_of("{webhooks}\x06\x163", cluster=False) == "{webhooks}", "a queue named so on a single Redis"
    with pytest.raises(ValueError, match="may not"):
        keys.wake("a{b}", cluster=True)


def test_on_a_single_redis_the_names_are_kombus_and_the_pipelines_own() -> None:
    assert keys.levels("email", cluster=False) == ["email", "email\x06\x163", "email\x06\x166", "email\x06\x169"]
    assert [keys.unacked("email", False), keys.unacked_index("email", False)] == [UNACKED_KEY, UNACKED_INDEX_KEY]
    assert keys.lease("email", cluster=False) == LEASE_KEY
    assert keys.paused("email", cluster=False) == PAUSED_KEY
    assert keys.delayed("email", cluster=False)[0] == DELAYED_KEY
    assert keys.group_count("email", cluster=False) == GROUP_COUNT_KEY
    assert keys.wake("email", cluster=False) == "pipeline:wake:email"
    assert keys.recent("email", cluster=False) == "pipeline:recent:email"
    assert keys.cancel("email", "id-1", cluster=False) == "pipeline:cancel:id-1"
    assert keys.idempotency("email", "email.send", "k", cluster=False) == "pipeline:enqueue:email.send:k"
    assert keys.group_jobs("email", "email", "g", cluster=False) == "pipeline:group:jobs:email:g"
    assert keys.levels("email") == keys.levels("email", cluster=False), "the session's REDIS_URL is a single Redis"
