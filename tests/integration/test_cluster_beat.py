"""Beat on a Redis Cluster URL: redbeat's schedule and lock live under one hash tag on the cluster, a due entry's job
lands in its queue's cluster list with the queue's wake-up marker, and of two beats only the lock holder sends, each
due time once.

A real 3+3 cluster (`redis_cluster`) and `celery beat` subprocesses on its URL; the outcome is read from the
cluster's keys (no worker: what beat sent stays in the queue's list).
"""

from __future__ import annotations

import itertools
import json
import signal
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from pipeline.constants import BEAT_CLUSTER_KEY_PREFIX, HEADER_PUBLISHED_AT, WORK_QUEUES
from pipeline.queues import keys
from tests.support.beat import Beat
from tests.support.cluster import Cluster
from tests.support.monitor import Monitor
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.integration

EVERY = 2.0
LOCK_TIMEOUT = 3
QUEUE = WORK_QUEUES[-1]
#: What beat logs of a write the replicas did not confirm (`NotReplicated`, then the tick's "nothing sent").
_SHORT = "Redis replica(s) confirmed the write within"


@pytest.fixture
def beats(redis_cluster: Cluster) -> Iterator[list[Beat]]:
    started: list[Beat] = []
    _clear(redis_cluster)
    yield started
    for beat in started:
        beat.stop()
    _clear(redis_cluster)


def _clear(cluster: Cluster) -> None:
    client = cluster.client()
    for queue in WORK_QUEUES:
        client.delete(*keys.levels(queue, True), keys.wake(queue, True))
    for node in cluster.seeds:
        for key in node.client().scan_iter(match=f"{BEAT_CLUSTER_KEY_PREFIX}*"):
            client.delete(key)


def _env(cluster: Cluster, key: str, queue: str = QUEUE, replicas: int = 0, every: float = EVERY) -> dict[str, str]:
    entry = {"task": "test.tick", "every": every, "payload": {"key": key}, "queue": queue}
    return {
        "REDIS_URL": cluster.url(),
        "BEAT_LOCK_TIMEOUT": str(LOCK_TIMEOUT),
        "BEAT_MAX_LOOP_INTERVAL": "1",
        "BEAT_SCHEDULE": json.dumps({f"tick-{key[:8]}": entry}),
        "REDIS_WAIT_REPLICAS": str(replicas),
    }


def _sent(cluster: Cluster, key: str, queue: str = QUEUE) -> list[dict[str, Any]]:
    """The envelopes of `test.tick` jobs for `key` in `queue`'s cluster lists."""
    client = cluster.client()
    found = []
    for level in keys.levels(queue, True):
        for raw in client.lrange(level, 0, -1):
            envelope = json.loads(raw)
            if envelope["headers"].get("task") == "test.tick" and key in str(envelope["headers"].get("argsrepr")):
                found.append(envelope)
    return found


def test_a_beat_on_a_cluster_sends_a_due_entry_into_its_queues_cluster_list(
    beats: list[Beat], redis_cluster: Cluster, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    beat = Beat(f"cl-{key[:6]}", work_dir / "logs", _env(redis_cluster, key)).start()
    beats.append(beat)
    wait_for(lambda: "beat: Acquired lock" in beat.log(), 60, 0.1, what="beat to take the lock on the cluster")
    wait_for(lambda: len(_sent(redis_cluster, key)) >= 2, 30, 0.1, what="two due jobs in the queue's cluster list")

    assert "Traceback" not in beat.log()
    assert redis_cluster.client().llen(keys.wake(QUEUE, True)) >= 1, "no wake-up marker with the job"
    beat_keys = [k for node in redis_cluster.seeds for k in node.client().scan_iter(match="pipeline:*beat*")]
    assert beat_keys and all(k.startswith(BEAT_CLUSTER_KEY_PREFIX.encode()) for k in beat_keys), beat_keys
    assert {key_slot(k) for k in beat_keys} == {key_slot(b"{beat}")}, "redbeat's keys span slots"
    lock = f"{BEAT_CLUSTER_KEY_PREFIX}:lock"
    assert redis_cluster.client().exists(lock), f"no lock at {lock}: {beat_keys}"


def test_two_beats_on_a_cluster_one_holds_the_lock_each_due_time_sent_once(
    beats: list[Beat], redis_cluster: Cluster, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    env = _env(redis_cluster, key)
    entry = f"tick-{key[:8]}"
    leader = Beat(f"cl-a-{key[:6]}", work_dir / "logs", env).start()
    beats.append(leader)
    wait_for(lambda: "beat: Acquired lock" in leader.log(), 60, 0.1, what="the first beat to take the lock")
    standby = Beat(f"cl-b-{key[:6]}", work_dir / "logs", env).start()
    beats.append(standby)
    wait_for(lambda: "beat v" in standby.log() or "Starting" in standby.log(), 60, 0.1, what="the standby started")
    wait_for(lambda: len(_sent(redis_cluster, key)) >= 5, 5 * EVERY + 20, 0.1, what="five sends")

    # The leader keeps sending: the list and its log agree between two sends (a send landing twice never does).
    wait_for(lambda: len(_sent(redis_cluster, key)) == leader.sent(entry), 3 * EVERY, 0.05, what="list == sends")
    sent = _sent(redis_cluster, key)
    assert standby.sent(entry) == 0 and "beat: Acquired lock" not in standby.log()
    assert min(_gaps(sent)) > EVERY / 2, f"a due time was sent twice: gaps {_gaps(sent)}"

    leader.kill()
    before = len(_sent(redis_cluster, key))
    wait_for(lambda: standby.sent(entry) >= 2, LOCK_TIMEOUT + 2 * EVERY + 20, 0.1, what="the standby to take over")
    assert "beat: Acquired lock" in standby.log()
    # Beat logs a send before it publishes it: stopped between the two, its last logged send never lands. So it is
    # stopped just after a send landed (the list caught up with its log), an interval before its next.
    wait_for(
        lambda: len(_sent(redis_cluster, key)) == before + standby.sent(entry), 3 * EVERY, 0.05, what="list == sends"
    )
    standby.stop()  # no send between the two counts below
    everything = _sent(redis_cluster, key)
    assert len(everything) == before + standby.sent(entry), f"the standby's log: {standby.log()[-4000:]}"
    assert min(_gaps(everything)) > EVERY / 2, f"a due time was sent twice: gaps {_gaps(everything)}"


def _gaps(envelopes: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive sends (each job's publish time, stamped in its headers)."""
    times = sorted(float(e["headers"][HEADER_PUBLISHED_AT]) for e in envelopes)
    return [b - a for a, b in itertools.pairwise(times)]


def test_beat_on_a_cluster_with_wait_replicas_sends_each_due_time_once_each_write_waited_on_its_connection(
    beats: list[Beat], redis_cluster: Cluster, work_dir: Path
) -> None:
    """REDIS_WAIT_REPLICAS=1: on the master serving `{beat}` (MONITOR), each renewal of the lock and each rewrite of
    an entry's run is followed by WAIT from the connection that wrote it; each due time lands once."""
    key = uuid.uuid4().hex
    entry = f"tick-{key[:8]}"
    master = redis_cluster.master_of(key_slot(b"{beat}"))
    beat = Beat(f"cl-wr-{key[:6]}", work_dir / "logs", _env(redis_cluster, key, replicas=1, every=1.0)).start()
    beats.append(beat)
    wait_for(lambda: "beat: Acquired lock" in beat.log(), 60, 0.1, what="beat to take the lock on the cluster")
    with Monitor(master.client()) as seen:
        wait_for(lambda: len(_sent(redis_cluster, key)) >= 5, 90, 0.1, what="five sends with REDIS_WAIT_REPLICAS=1")
    beat.stop()
    sent, logged = _sent(redis_cluster, key), beat.sent(entry)
    # Beat logs a send before it publishes it: the stop may fall between the two for its last one.
    assert logged - 1 <= len(sent) <= logged, f"{len(sent)} landed of {logged} sent: {beat.log()[-4000:]}"
    assert min(_gaps(sent)) > 0.5, f"a due time was sent twice: gaps {_gaps(sent)}"
    assert _SHORT not in beat.log() and "Traceback" not in beat.log(), beat.log()[-4000:]

    renewals, runs = _beat_writes(seen.commands)
    assert len(renewals) >= 3 and len(runs) >= 3, (renewals, runs)
    assert all(after == "WAIT" for after in renewals), f"a renewal not followed by WAIT on its connection: {renewals}"
    assert all(runs.values()), f"a run never followed by WAIT on the connection that wrote it: {runs}"


def _beat_writes(commands: list[dict[str, Any]]) -> tuple[list[str], dict[str, bool]]:
    """What each connection sent next after each renewal of beat's lock (its extend-to script); and for each run of
    an entry written (its `meta`), whether a connection wrote it (HSET, then the schedule's ZADD) followed by WAIT.
    redbeat writes each run first, with no WAIT; beat writes the same run again, then WAIT."""
    sequences: dict[tuple[str, int], list[list[str]]] = defaultdict(list)
    for command in commands:
        if command["client_type"] != "lua":
            sequences[(command["client_address"], command["client_port"])].append(command["command"].split())
    lock, schedule = f"{BEAT_CLUSTER_KEY_PREFIX}:lock", f"{BEAT_CLUSTER_KEY_PREFIX}:schedule"
    renewals: list[str] = []
    runs: dict[str, bool] = {}
    for sequence in sequences.values():
        names = [words[0].upper() for words in sequence] + ["(nothing)", "(nothing)"]
        for index, words in enumerate(sequence):
            if names[index] == "EVALSHA" and words[3:4] == [lock]:
                renewals.append(names[index + 1])
            elif names[index] == "HSET" and words[2:3] == ["meta"]:
                waited = names[index + 1 : index + 3] == ["ZADD", "WAIT"] and sequence[index + 1][1] == schedule
                runs[" ".join(words[1:])] = runs.get(" ".join(words[1:]), False) or waited
    return renewals, runs


def test_beat_on_a_cluster_sends_nothing_the_replica_of_its_master_does_not_confirm(
    beats: list[Beat], redis_cluster: Cluster, work_dir: Path
) -> None:
    """The replica of the master serving `{beat}` stopped (SIGSTOP): beat's WAIT, on that master, is short of it (a
    WAIT another master ran would count that master's replica), so beat reports it and sends nothing; continued
    (SIGCONT), beat sends again, each due time once."""
    key = uuid.uuid4().hex
    replica = redis_cluster.replica_of(redis_cluster.master_of(key_slot(b"{beat}")))
    assert replica.proc is not None
    beat = Beat(f"cl-ws-{key[:6]}", work_dir / "logs", _env(redis_cluster, key, replicas=1, every=1.0)).start()
    beats.append(beat)
    wait_for(lambda: len(_sent(redis_cluster, key)) >= 2, 90, 0.1, what="two sends before the replica stops")

    replica.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: beat.log().count(_SHORT) >= 2, 60, 0.1, what="beat to report writes short of the replica")
        held = len(_sent(redis_cluster, key))
        shorts = beat.log().count(_SHORT)
        wait_for(lambda: beat.log().count(_SHORT) >= shorts + 3, 60, 0.1, what="three more ticks short of it")
        assert len(_sent(redis_cluster, key)) == held, "beat sent what the replica did not confirm"
        assert "nothing sent" in beat.log()
    finally:
        replica.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: len(_sent(redis_cluster, key)) >= held + 2, 60, 0.1, what="sends once the replica answers")
    beat.stop()
    sent = _sent(redis_cluster, key)
    assert min(_gaps(sent)) > 0.5, f"a due time was sent twice: gaps {_gaps(sent)}"
    assert "Traceback" not in beat.log(), beat.log()[-4000:]


def test_a_job_beat_sends_on_a_cluster_runs_on_a_cluster_worker_once_per_due_time(
    beats: list[Beat], redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    entry = f"tick-{key[:8]}"
    env = {**_env(redis_cluster, key), "RESULT_BACKEND_URL": ledger_redis.url, "TEST_LEDGER_URL": ledger_redis.url}
    make_worker(f"cl-beat-{key[:6]}", env=env, queues=QUEUE, concurrency=1)
    beat = Beat(f"cl-w-{key[:6]}", work_dir / "logs", env).start()
    beats.append(beat)

    def ran() -> list[float]:
        return sorted(float(x) for x in ledger_redis.client().lrange(f"test:tick:{key}", 0, -1))

    wait_for(lambda: len(ran()) >= 3, 3 * EVERY + 60, 0.1, what="three beat jobs run by the cluster worker")
    beat.stop()
    wait_for(lambda: len(ran()) == beat.sent(entry), 30, 0.1, what="every job beat sent to have run")
    assert len(ran()) == beat.sent(entry) >= 3
    assert min(b - a for a, b in itertools.pairwise(ran())) > EVERY / 2, f"a due time ran twice: {ran()}"
    assert not _sent(redis_cluster, key), "the worker drained the queue's cluster list"


@pytest.mark.parametrize("replicas", [0, 1])
def test_beat_follows_a_failover_of_the_master_serving_its_keys(
    beats: list[Beat], redis_cluster: Cluster, work_dir: Path, replicas: int
) -> None:
    """The master serving beat's slot is killed and its replica promoted: beat goes on sending, each due time once.
    The jobs go to a queue on another master, so what is counted there is not what the failover may lose. With
    REDIS_WAIT_REPLICAS=1 beat's writes count once the promoted master has a replica again: the killed node rejoins
    before the sends are awaited (beat's WAIT follows the slot to the new master)."""
    key = uuid.uuid4().hex
    master = redis_cluster.master_of(key_slot(b"{beat}"))
    queue = next(q for q in WORK_QUEUES if redis_cluster.master_of(key_slot(q.encode())).port != master.port)
    env = _env(redis_cluster, key, queue, replicas=replicas)
    beat = Beat(f"cl-fo{replicas}-{key[:6]}", work_dir / "logs", env).start()
    beats.append(beat)
    wait_for(lambda: len(_sent(redis_cluster, key, queue)) >= 2, 60, 0.1, what="two sends before the failover")

    promoted = redis_cluster.fail_over(master)
    try:
        if replicas:
            redis_cluster.restart(master)
        failed_over = len(_sent(redis_cluster, key, queue))
        wait_for(
            lambda: len(_sent(redis_cluster, key, queue)) >= failed_over + 3,
            LOCK_TIMEOUT + 3 * EVERY + 30,
            0.1,
            what="three sends after the failover",
        )
    finally:
        if master.proc is None:
            redis_cluster.restart(master)
    assert redis_cluster.master_of(key_slot(b"{beat}")).port == promoted.port
    beat.stop()
    sent = _sent(redis_cluster, key, queue)
    # Its log cannot count sends across the failover: a tick that ends on the dead master's error may come before or
    # after its send reached the queue's (live) master. What holds is in the list: no due time twice (the gaps).
    assert min(_gaps(sent)) > EVERY / 2, f"a due time was sent twice: gaps {_gaps(sent)}"
