"""`pipeline queues` on a Redis Cluster URL: each queue's depth read through the cluster client, its slot and the
master serving it, in text and with --json; after a failover, the master that took the slot over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from redis.crc import key_slot

from pipeline.constants import DEAD_LETTER_QUEUE, WORK_QUEUES
from pipeline.queues import keys
from tests.support.cluster import Cluster
from tests.support.procs import ROOT


def _queues(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": cluster.url()}
    argv = [sys.executable, "-m", "pipeline", "queues", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def _shown(cluster: Cluster) -> dict[str, dict[str, Any]]:
    done = _queues(cluster, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return {q["name"]: q for q in json.loads(done.stdout)["queues"]}


def test_queues_shows_each_queues_depth_slot_and_master_on_a_cluster(redis_cluster: Cluster) -> None:
    client = redis_cluster.client()
    urgent, later = keys.levels("webhooks", cluster=True)[0], keys.levels("webhooks", cluster=True)[2]
    client.lpush(urgent, "a", "b")
    client.lpush(later, "c")
    try:
        shown = _shown(redis_cluster)
        assert set(shown) == {*WORK_QUEUES, DEAD_LETTER_QUEUE}
        for name, queue in shown.items():
            slot = key_slot(name.encode())
            assert queue["slot"] == slot
            assert queue["master"] == f"127.0.0.1:{redis_cluster.master_of(slot).port}"
        assert shown["webhooks"]["depth"] == 3
        assert shown["webhooks"]["levels"] == {"0": 2, "3": 0, "6": 1, "9": 0}
        assert len({q["master"] for q in shown.values()}) > 1, "the queues spread over the masters"

        text = _queues(redis_cluster)
        assert text.returncode == 0, text.stderr[-2000:]
        header, *rows = text.stdout.splitlines()
        assert header.split()[-2:] == ["SLOT", "MASTER"]
        row = next(r for r in rows if r.startswith("webhooks "))
        assert row.split()[1] == "3" and row.split()[-2:] == [str(key_slot(b"webhooks")), shown["webhooks"]["master"]]
    finally:
        client.delete(urgent, later)


def test_after_a_failover_queues_names_the_promoted_master(redis_cluster: Cluster) -> None:
    slot = key_slot(b"email")
    master = redis_cluster.master_of(slot)
    try:
        promoted = redis_cluster.fail_over(master)
        assert _shown(redis_cluster)["email"]["master"] == f"127.0.0.1:{promoted.port}"
    finally:
        if master.proc is None:
            redis_cluster.restart(master)
