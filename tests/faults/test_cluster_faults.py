"""The delivery promise on a Redis Cluster under faults: a master killed under load (its replica promoted by the
cluster), and a queue's slot migrated to another master under load. Each counts the jobs acknowledged to the producer
against the jobs run, at the side effect (the ledger), two leases past the last finish: lost 0, none run twice.

A cluster of this module's own (3 masters, 3 replicas: `tests.support.cluster`), since the faults change which node
serves what. The producers are the pipeline's (`enqueue` with REDIS_WAIT_REPLICAS=1, an idempotency key per job,
retried with the key on any error: `tests.support.cluster_stream`), one process per queue; the workers are
`celery worker` subprocesses with REDIS_WAIT_REPLICAS=1 too, on both queues. Nothing is restarted but the fault.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import key_slot

from pipeline.constants import WORK_QUEUES
from pipeline.queues import keys
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, done, starts
from tests.support.cluster import Cluster
from tests.support.procs import ROOT, RedisServer, wait_for
from tests.support.replicas import Replicated

pytestmark = pytest.mark.faults

#: The lease of the failover test: above the failover's time (the cluster's node timeout, 2 s here, then the
#: election; 3-6 s measured on a loaded machine) plus a renewal interval. A worker that cannot renew its lease
#: for that long stops its job unacknowledged, and it runs again: with a 6 s lease, a job finishing during the
#: failover ran twice (its lease lapsed while the slot had no master).
FAILOVER_LEASE_S = 12.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = Cluster(Path(tmp_path_factory.mktemp("fault-cluster"))).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicated]:
    """The workers' result backend (RESULT_BACKEND_URL): a Redis with a replica, so its WAIT is answered too."""
    started = Replicated(Path(tmp_path_factory.mktemp("fault-results"))).start()
    yield started
    started.stop()


def _two_queues(cluster: Cluster) -> tuple[str, str]:
    """Two work queues whose slots are served by different masters."""
    master = {queue: cluster.master_of(key_slot(queue.encode())).port for queue in WORK_QUEUES}
    return next((a, b) for a in WORK_QUEUES for b in WORK_QUEUES if master[a] != master[b])


def _env(cluster: Cluster, results: Replicated, ledger: RedisServer, lease_s: float = SHORT_LEASE_S) -> dict[str, str]:
    return {
        "REDIS_URL": cluster.url(),
        "RESULT_BACKEND_URL": results.url,
        "TEST_LEDGER_URL": ledger.url,
        "REDIS_WAIT_REPLICAS": "1",
        **SHORT_LEASE,
        "LEASE_SECONDS": str(int(lease_s)),
    }


class Streams:
    """One producer process per queue, each enqueueing until told to stop."""

    def __init__(self, env: dict[str, str], ledger: RedisServer, key: str, queues: tuple[str, ...]) -> None:
        self.ledger, self.key, self.queues = ledger, key, queues
        argv = [sys.executable, "-m", "tests.support.cluster_stream"]
        self.procs = [
            subprocess.Popen(
                [*argv, queue, key, "0.02"],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for queue in queues
        ]

    def acked(self, queue: str | None = None) -> list[str]:
        """The ids acknowledged to the producer of `queue` (None: of every queue)."""
        client = self.ledger.client()
        lists = [f"test:acked:{self.key}:{q}" for q in self.queues if queue in (None, q)]
        return [x.decode() for name in lists for x in client.lrange(name, 0, -1)]

    def errors(self) -> list[str]:
        return [x.decode() for x in self.ledger.client().lrange(f"test:errors:{self.key}", 0, -1)]

    def stop(self) -> list[dict[str, Any]]:
        self.ledger.client().set(f"test:stop:{self.key}", 1)
        outs = []
        for proc in self.procs:
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
        return outs

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def streams() -> Iterator[list[Streams]]:
    started: list[Streams] = []
    yield started
    for stream in started:
        stream.kill()


def _past_two_leases(ledger: RedisServer, key: str, lease_s: float) -> None:
    """Wait until 2 x LEASE_SECONDS after the last completion's record, on the ledger's clock."""
    client = ledger.client()
    last = max(json.loads(x)["t"] for x in client.lrange(f"test:ledger:{key}", 0, -1))

    def past() -> bool:
        seconds, micros = client.time()
        return bool(seconds + micros / 1e6 >= last + 2 * lease_s)

    wait_for(past, 6 * lease_s, 0.2, what="two leases past the last job")


def _held(cluster: Cluster, queue: str) -> int:
    client = cluster.client()
    try:
        return int(client.hlen(keys.unacked(queue, True))) + int(client.hlen(keys.lease(queue, True)))
    finally:
        client.close()


def _where(cluster: Cluster, queues: tuple[str, ...], jobs: list[str]) -> dict[str, list[str]]:
    """Where each of `jobs` is on the cluster: which queue's list or delivery records name it."""
    client = cluster.client()
    found: dict[str, list[str]] = {job: [] for job in jobs}
    try:
        for queue in queues:
            held = [keys.unacked(queue, True)]
            for name in keys.levels(queue, True):
                for raw in client.lrange(name, 0, -1):
                    task_id = json.loads(raw)["headers"]["id"]
                    if task_id in found:
                        found[task_id].append(name)
            for name in held:
                for raw in client.hvals(name):
                    task_id = json.loads(raw)[0]["headers"]["id"] if raw.startswith(b"[") else ""
                    if task_id in found:
                        found[task_id].append(name)
    finally:
        client.close()
    return found


def _count(cluster: Cluster, ledger: RedisServer, key: str, acked: list[str], queues: tuple[str, ...]) -> None:
    """Every acknowledged job ran (lost 0), and no job ran twice; print the tally."""
    finished, ran = done(ledger, key), collections.Counter(s["task_id"] for s in starts(ledger, key))
    lost = [job for job in acked if finished[job] == 0]
    twice = {job: n for job, n in finished.items() if n > 1}
    started_twice = {job: n for job, n in ran.items() if n > 1}
    print(f"acked {len(acked)}, finished {len(finished)}, lost {len(lost)}, run twice {len(twice)}")
    where = _where(cluster, queues, lost)
    print("lost, by where they are:", collections.Counter(",".join(w) for w in where.values()))
    assert not lost, (len(lost), dict(list(where.items())[:10]))
    assert not twice, twice
    assert not started_twice, started_twice


def _flowing(streams: Streams, ledger: RedisServer, key: str, since: float, per_queue: int) -> bool:
    """At least `per_queue` jobs of each queue's producer started after `since` (the ledger's clock)."""
    started = {s["task_id"] for s in starts(ledger, key) if s["t"] > since}
    return all(len(started & set(streams.acked(queue))) >= per_queue for queue in streams.queues)


def _ledger_now(ledger: RedisServer) -> float:
    seconds, micros = ledger.client().time()
    return seconds + micros / 1e6


def _settle(
    cluster: Cluster, ledger: RedisServer, key: str, stream: Streams, queues: tuple[str, ...], lease_s: float
) -> None:
    outs = stream.stop()
    acked = stream.acked()
    print(
        f"producers: {outs}; errors seen and retried: {collections.Counter(e.split(':')[0] for e in stream.errors())}"
    )
    with contextlib.suppress(TimeoutError):  # a job still missing then is counted lost below, with where it is
        wait_for(lambda: set(acked) <= set(done(ledger, key)), 60, 0.2, what="every acknowledged job to finish")
    _past_two_leases(ledger, key, lease_s)
    _count(cluster, ledger, key, acked, queues)
    assert all(_held(cluster, queue) == 0 for queue in queues), "nothing left held"


def test_a_master_killed_under_load_loses_no_acknowledged_job_and_runs_none_twice(
    cluster: Cluster, results: Replicated, ledger_redis: RedisServer, make_worker: Any, streams: list[Streams]
) -> None:
    one, other = _two_queues(cluster)
    key = uuid.uuid4().hex
    env = _env(cluster, results, ledger_redis, FAILOVER_LEASE_S)
    for name in ("a", "b"):
        make_worker(f"cl-fo-{name}-{key[:6]}", env=env, queues=f"{one},{other}", concurrency=2)
    stream = Streams(env, ledger_redis, key, (one, other))
    streams.append(stream)
    wait_for(lambda: _flowing(stream, ledger_redis, key, 0, 15), 60, 0.1, what="jobs flowing on both queues")
    master = cluster.master_of(key_slot(one.encode()))
    killed = time.monotonic()
    promoted = cluster.fail_over(master)
    print(f"the replica on port {promoted.port} served the slots {time.monotonic() - killed:.1f} s after the kill")
    assert cluster.master_of(key_slot(one.encode())).port == promoted.port
    after = _ledger_now(ledger_redis)
    cluster.restart(master)  # back as the new master's replica: writes can reach a replica again (WAIT)
    n = len(stream.acked())
    wait_for(lambda: len(stream.acked()) >= n + 30, 60, 0.1, what="the producers to go on after the failover")
    wait_for(lambda: _flowing(stream, ledger_redis, key, after, 15), 60, 0.1, what="the workers to go on after it")
    _settle(cluster, ledger_redis, key, stream, (one, other), FAILOVER_LEASE_S)


def _migrate_slot(cluster: Cluster, slot: int, target_port: int) -> None:
    """Move `slot` to the master on `target_port` as `redis-cli --cluster reshard` does: IMPORTING on the target,
    MIGRATING on the source, MIGRATE the keys a batch at a time, then SETSLOT NODE on both and on every other master."""
    move = cluster.move(slot, target_port)
    move.finish(pause_s=0.2)  # a key at a time, slowly: jobs flow while the slot is half moved (ASK, TRYAGAIN)
    print(f"slot {slot}: {move.moved} key(s) migrated from {move.source.port} to {move.target.port}")


def test_a_slot_migrated_under_load_loses_no_job_and_runs_none_twice(
    cluster: Cluster, results: Replicated, ledger_redis: RedisServer, make_worker: Any, streams: list[Streams]
) -> None:
    one, other = _two_queues(cluster)
    key = uuid.uuid4().hex
    env = _env(cluster, results, ledger_redis)
    make_worker(f"cl-mig-{key[:6]}", env=env, queues=f"{one},{other}", concurrency=2)
    stream = Streams(env, ledger_redis, key, (one, other))
    streams.append(stream)
    wait_for(lambda: _flowing(stream, ledger_redis, key, 0, 15), 60, 0.1, what="jobs flowing on both queues")
    slot, target = key_slot(one.encode()), cluster.master_of(key_slot(other.encode())).port
    began = _ledger_now(ledger_redis)
    _migrate_slot(cluster, slot, target)
    ended = _ledger_now(ledger_redis)
    during = {s["task_id"] for s in starts(ledger_redis, key) if began < s["t"] < ended} & set(stream.acked(one))
    print(f"{len(during)} job(s) of {one} started while its slot was moving ({ended - began:.1f} s)")  # measured
    wait_for(lambda: cluster.master_of(slot).port == target, 20, 0.1, what="every node to name the new owner")
    after = _ledger_now(ledger_redis)
    wait_for(lambda: _flowing(stream, ledger_redis, key, after, 15), 60, 0.1, what="jobs flowing after the move")
    _settle(cluster, ledger_redis, key, stream, (one, other), SHORT_LEASE_S)
