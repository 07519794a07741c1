"""Partitioned hosts: a worker cut off from Redis stops its jobs before their lease lapses (`LeaseLost`) and records
them abandoned, a peer runs them once, and nothing of the cut-off copies is stored or acknowledged after the heal; a
job that finished during a cut shorter than its lease is acknowledged after the heal and runs once.

The cut-off workers (a prefork one, a solo one and an asyncio pool) run on a "host" of their own: a network namespace
joined to this machine by a veth pair (`tests.support.netns`), reaching the broker (a redis-server of this module's,
bound to 127.0.0.1 and this side's veth address) only over that link. The peer runs on this machine on 127.0.0.1 and
also consumes the cut-off workers' job queues, so it can take their jobs over. The cut is this side's veth set down:
packets are dropped, neither end gets an error. Jobs (`test.run`, `test.run_async`) record each run's start, finish (the
side effect a job must not make twice) or stop in a ledger Redis every worker reaches over a Unix socket, so the record
is whole through the cut; the stored result names the worker that ran it. Every worker uses a 5 s lease, a 1 s sweep
and a prefetch of one job per process.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from pipeline.constants import DEAD_LETTER_QUEUE, LEASE_KEY
from pipeline.runtime.asyncpool import POOL
from tests.support import netns
from tests.support.procs import Worker, wait_for, waiting
from tests.support.topology import Node

pytestmark = pytest.mark.ha

LEASE_S = 5
ENV = {"LEASE_SECONDS": str(LEASE_S), "UNACKED_RESTORE_INTERVAL": "1", "WORKER_PREFETCH_MULTIPLIER": "1"}
#: A job that would run past the peer's takeover (a lease and a sweep after the cut) and end during the cut.
FINISHES_IN_CUT_S = 10
#: A cut shorter than the lease, started just after a renewal.
SHORT_CUT_S = 2.0
PEER_SLOTS = 4


@dataclass
class Site:
    """The module's topology. Queues: `jobs` (the prefork cut-off worker's and the peer's), `solo_jobs` and `aio_jobs`
    (the solo and asyncio cut-off workers' and the peer's), `own`/`solo_own`/`aio_own` (each cut-off worker's alone),
    `blockers` (the peer's alone)."""

    host: netns.Host
    broker: Node
    ledger: Node
    cut_off: Worker
    solo: Worker
    aio: Worker
    peer: Worker
    producer: Celery
    tag: str

    def queue(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def send(self, key: str, queue: str, task: str = "test.run", **payload: Any) -> str:
        job = self.producer.send_task(task, args=[{"key": key, **payload}], queue=self.queue(queue))
        return str(job.id)

    def release(self, *keys: str) -> None:
        for key in keys:
            self.ledger.client().set(f"test:release:{key}", 1)

    def records(self, key: str, event: str) -> list[dict[str, Any]]:
        raw = self.ledger.client().lrange(f"test:run:{key}", 0, -1)
        return [r for r in map(json.loads, raw) if r["event"] == event]

    def ran_on(self, key: str, event: str) -> list[str]:
        """The worker names (`-n`, without `@host`) of the runs of `key` that recorded `event`, in order."""
        return [r["node"].split("@")[0] for r in self.records(key, event)]

    def now(self) -> float:
        seconds, micros = self.ledger.client().time()
        return float(seconds + micros / 1e6)

    def settled(self) -> bool:
        """Nothing queued or held: every job is acknowledged, none can run (again)."""
        client = self.broker.client()
        names = ("jobs", "solo_jobs", "aio_jobs", "own", "solo_own", "aio_own", "blockers")
        queued = sum(waiting(client, self.queue(q)) for q in names)
        return client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0 and queued == 0

    def stored_by(self, task_id: str) -> str:
        """The worker name in the job's stored SUCCESS."""
        found = self.producer.AsyncResult(task_id)
        assert found.state == "SUCCESS", (task_id, found.state)
        return str(found.result["node"]).split("@")[0]


def _start_together(workers: list[Worker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        for started in [pool.submit(w.start) for w in workers]:
            started.result()


@pytest.fixture(scope="module")
def site(work_dir: Path) -> Iterator[Site]:
    netns.require()
    tag = uuid.uuid4().hex[:6]
    base = work_dir / f"partition-{tag}"
    host = netns.Host().create()
    started: list[Any] = []
    try:
        broker = Node(base / "broker", options=("--bind", "127.0.0.1", host.address, "--protected-mode", "no"))
        started.append(broker.start())
        socket_path = base / "ledger" / "ledger.sock"
        ledger = Node(base / "ledger", options=("--unixsocket", str(socket_path), "--unixsocketperm", "777"))
        started.append(ledger.start())
        env = {**ENV, "TEST_LEDGER_URL": f"unix://{socket_path}"}
        inside = {**env, "REDIS_URL": f"redis://{host.address}:{broker.port}/0"}
        cut_off = Worker(f"cutoff-{tag}", base, inside, queues=f"jobs-{tag},own-{tag}")
        solo = Worker(f"solo-{tag}", base, inside, queues=f"solo_jobs-{tag},solo_own-{tag}", pool="solo", concurrency=1)
        aio_env = {**inside, "CELERY_CUSTOM_WORKER_POOL": POOL, "TEST_NODE": f"aio-{tag}"}
        aio = Worker(f"aio-{tag}", base, aio_env, queues=f"aio_jobs-{tag},aio_own-{tag}", pool="custom", concurrency=4)
        for worker in (cut_off, solo, aio):
            worker.argv = host.prefix() + worker.argv
        url = f"redis://127.0.0.1:{broker.port}/0"
        peer_queues = f"blockers-{tag},jobs-{tag},solo_jobs-{tag},aio_jobs-{tag}"
        peer_env = {**env, "REDIS_URL": url, "TEST_NODE": f"peer-{tag}"}
        peer = Worker(f"peer-{tag}", base, peer_env, queues=peer_queues, concurrency=PEER_SLOTS)
        started += [cut_off, solo, aio, peer]
        _start_together([cut_off, solo, aio, peer])
        producer = Celery(f"partition-{tag}", broker=url, backend=url, set_as_current=False)
        producer.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
        yield Site(host, broker, ledger, cut_off, solo, aio, peer, producer, tag)
        producer.close()
    finally:
        host.heal()  # a failed test may leave the link down: the workers would stop only in their own time
        for proc in started:
            if isinstance(proc, Worker):
                proc.terminate()
        for proc in reversed(started):
            proc.stop()
        host.destroy()


def test_workers_cut_off_stop_their_jobs_before_the_lease_lapses_and_serve_after_the_heal(site: Site) -> None:
    """The cut-off host runs four jobs that would end during the cut when its link is cut: two sync ones on the prefork
    worker (in pool children; one ignores every exception raised in it), one on the solo worker (in its main thread), an
    async one on the asyncio pool. Each cut-off worker stops its jobs (`LeaseLost`) before the lease lapses, while Redis
    is unreachable (the job that goes on is killed with its pool process at the lapse), and records the attempts as
    abandoned; the peer takes the four over after the lease and holds its copies until the test releases them, after
    the heal. Each job's body then completed once, on the peer: no finish of a cut-off copy, the stop
    before the peer's start, the peer's SUCCESS the only result, nothing acknowledged by the cut-off workers, nothing
    dead-lettered. Then each cut-off worker runs a job sent to its own queue."""
    key = uuid.uuid4().hex[:10]
    cut_off, solo, aio, peer = site.cut_off.name, site.solo.name, site.aio.name, site.peer.name
    blockers = [f"{key}-b{n}" for n in range(PEER_SLOTS)]
    for blocker in blockers:  # the peer's slots taken while the cut-off workers fetch the jobs
        site.send(blocker, "blockers", ends="release")
    wait_for(lambda: all(site.ran_on(b, "start") for b in blockers), 30, 0.05, what="the peer to hold the blockers")
    child, stubborn, main, coroutine = f"{key}-c", f"{key}-i", f"{key}-s", f"{key}-a"
    jobs = {
        child: site.send(child, "jobs", sleep_s=FINISHES_IN_CUT_S, ends="rerun_release"),
        stubborn: site.send(stubborn, "jobs", sleep_s=FINISHES_IN_CUT_S, ends="rerun_release", ignores_stop=True),
        main: site.send(main, "solo_jobs", sleep_s=FINISHES_IN_CUT_S, ends="rerun_release"),
        coroutine: site.send(coroutine, "aio_jobs", "test.run_async", sleep_s=FINISHES_IN_CUT_S, ends="rerun_release"),
    }
    first = {child: cut_off, stubborn: cut_off, main: solo, coroutine: aio}
    wait_for(lambda: all(site.ran_on(k, "start") for k in jobs), 30, 0.05, what="the jobs to start")
    assert {k: site.ran_on(k, "start") for k in jobs} == {k: [w] for k, w in first.items()}
    site.release(*blockers)
    site.host.cut()
    cut_at = site.now()
    logs = (site.cut_off, site.cut_off, site.solo, site.aio)
    try:
        wait_for(lambda: all(len(site.ran_on(k, "start")) >= 2 for k in jobs), 30, 0.1, what="the peer's takeover")
        taken_after = max(site.records(k, "start")[1]["t"] for k in jobs) - cut_at
        in_threads = (child, main)  # a prefork child, a solo worker's main thread: stopped whatever the event loop does
        wait_for(lambda: all(site.records(k, "stopped") for k in in_threads), 10, 0.1, what="the sync jobs to stop")
        killed = f"job test.run[{jobs[stubborn]}] ignored LeaseLost until its lease lapsed: killing"
        wait_for(lambda: killed in site.cut_off.log(), 10, 0.1, what="the job that went on to be killed at the lapse")
    finally:
        site.host.heal()
    healed_at = site.now()
    wait_for(
        lambda: all(_mentions_abandoned(w.log(), jobs[k]) for w, k in zip(logs, jobs, strict=True)),
        30,
        0.1,
        what="the cut-off workers to record their attempts abandoned",
    )
    broker = site.broker.client()
    holders = {v.decode().split(":")[1] for v in broker.hvals(LEASE_KEY)}
    held = broker.hlen("unacked")
    states = {k: site.producer.AsyncResult(task_id).state for k, task_id in jobs.items()}
    site.release(*jobs)
    wait_for(lambda: all(peer in site.ran_on(k, "finish") for k in jobs), 30, 0.1, what="the peer to finish them")
    wait_for(site.settled, 15, 0.1, what="every acknowledgement, with no copy left to run")
    stopped = {k[-1]: round(site.records(k, "stopped")[0]["t"] - cut_at, 1) for k in jobs if site.records(k, "stopped")}
    print(
        f"cut at 0: the cut-off workers stopped their jobs after {stopped} s, the peer took them over after"
        f" {taken_after:.1f} s (lease {LEASE_S} s); healed after {healed_at - cut_at:.1f} s"
    )

    assert holders == {str(site.peer.pid)} and held == len(jobs), "a cut-off worker acknowledged a job the peer held"
    assert states == dict.fromkeys(jobs, "PENDING"), f"a result stored by a cut-off worker: {states}"
    assert {k: site.ran_on(k, "start") for k in jobs} == {k: [w, peer] for k, w in first.items()}
    assert {k: site.ran_on(k, "finish") for k in jobs} == {k: [peer] for k in jobs}, "a body completed twice"
    stopped_by_exception = {k: [w] for k, w in first.items() if k != stubborn}
    assert {k: site.ran_on(k, "stopped") for k in jobs} == {**stopped_by_exception, stubborn: []}, (
        "a cut-off copy was not stopped by LeaseLost"
    )
    # The job that went on after LeaseLost was ended with its pool process at the lapse: it never finished there.
    assert site.ran_on(stubborn, "ignored") == [cut_off]
    assert f"job test.run[{jobs[child]}] ignored LeaseLost" not in site.cut_off.log()
    for k in in_threads:  # stopped before its lease lapsed: before the peer could start its copy
        assert site.records(k, "stopped")[0]["t"] < site.records(k, "start")[1]["t"], k
    # The async job's coroutine runs only when the asyncio pool's event loop turns, which a Redis call hanging on the
    # cut link can hold up; it was stopped first when the loop turned again, before it could finish.
    assert site.records(coroutine, "stopped")[0]["t"] < site.records(coroutine, "finish")[0]["t"]
    stored = {k: site.stored_by(task_id) for k, task_id in jobs.items()}
    assert stored == dict.fromkeys(jobs, peer), f"a result stored by a cut-off worker: {stored}"
    assert broker.llen(DEAD_LETTER_QUEUE) == 0
    assert all("terminating it here" not in w.log() for w in logs)

    after = {
        cut_off: site.send(f"{key}-after", "own"),
        solo: site.send(f"{key}-solo-after", "solo_own"),
        aio: site.send(f"{key}-aio-after", "aio_own", "test.run_async"),
    }
    ready = [site.producer.AsyncResult(task_id) for task_id in after.values()]
    wait_for(lambda: all(r.ready() for r in ready), 30, 0.1, what="the cut-off workers to serve again")
    assert {name: site.stored_by(task_id) for name, task_id in after.items()} == {w: w for w in after}
    assert all(w.proc is not None and w.proc.poll() is None for w in logs)


def _mentions_abandoned(log: str, task_id: str) -> bool:
    return any(task_id in line and "abandoned" in line for line in log.splitlines())


def _renewed(client: redis.Redis, before: list[tuple[bytes, float]]) -> bool:
    now = client.zrange("unacked_index", 0, -1, withscores=True)
    return bool(now) and now != before


def test_a_job_that_ends_during_a_cut_shorter_than_its_lease_is_acknowledged_after_the_heal_and_runs_once(
    site: Site,
) -> None:
    """The cut starts just after a renewal and lasts less than the lease; the job ends during it, on the cut-off host.
    Its result and acknowledgement reach Redis after the heal: no peer restores it, it runs once, nothing stays held."""
    key = uuid.uuid4().hex[:10]
    cut_off = site.cut_off.name
    restored_before = site.peer.log().count("whose lease expired")
    lost_before = site.cut_off.log().count("lease lost")
    task_id = site.send(key, "own", ends="release")
    wait_for(lambda: site.ran_on(key, "start"), 30, 0.05, what="the job to start")
    broker = site.broker.client()
    wait_for(lambda: broker.zcard("unacked_index") == 1, 10, 0.02, what="its lease")
    before = broker.zrange("unacked_index", 0, -1, withscores=True)
    wait_for(lambda: _renewed(broker, before), LEASE_S, 0.01, what="a renewal")
    site.host.cut()
    cut_at = time.monotonic()
    try:
        site.release(key)
        wait_for(lambda: site.records(key, "finish"), SHORT_CUT_S, 0.02, what="the job to end during the cut")
        time.sleep(max(0.0, cut_at + SHORT_CUT_S - time.monotonic()))  # the cut itself, not a wait for an outcome
    finally:
        site.host.heal()
    healed_at, healed = site.now(), time.monotonic()
    wait_for(lambda: site.producer.AsyncResult(task_id).ready(), 20, 0.1, what="its result")
    wait_for(site.settled, 20, 0.1, what="its acknowledgement after the heal, with no copy left to run")
    print(f"a {SHORT_CUT_S:.0f} s cut: result and acknowledgement in Redis {time.monotonic() - healed:.1f} s after it")

    assert site.ran_on(key, "start") == [cut_off] and site.ran_on(key, "finish") == [cut_off]
    assert site.records(key, "finish")[0]["t"] < healed_at, "the job ended during the cut"
    assert site.stored_by(task_id) == cut_off
    assert site.peer.log().count("whose lease expired") == restored_before
    assert site.cut_off.log().count("lease lost") == lost_before
