"""Exactly-once joins: a fan-in step is queued once, when its last parent succeeds, whatever happens to the parents.

Parents finishing at the same instant on two workers, a worker `kill -9`ed while it runs fan-out items, a Redis
restart in the middle of the fan-out, a parent run twice (its message published again while the first copy runs,
and again after the flow finished: a lost acknowledgement), and `flow_advance.lua` called for every item from many
threads at once. Each scenario counts with a ledger Redis the test never stops: every item ran to a finish at least
once and is recorded, the flow succeeded, the join ran once with every result (its key says how many it was
given), nothing was dead-lettered. Then the shipped media flow: its transcode worker `kill -9`ed mid-transcode, one
signed webhook with the three renditions.

The workers run on a redis-server of the test's own (`own_redis`) with a short lease (5 s), so a killed worker's
items come back within seconds; flows are started and read through `tests.support.flow_client` (the test process's
settings are the session Redis's).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from pipeline.broker import queue_keys
from pipeline.constants import DEAD_LETTER_QUEUE, DELIVERIES_KEY, DLQ_INDEX_KEY, LEASE_KEY, UNACKED_KEY
from tasks import webhook_http
from tests.conftest import TEST_ENV
from tests.support.flow_client import FlowClient
from tests.support.http_peer import HttpPeer
from tests.support.media import make_clip
from tests.support.procs import RedisServer, Worker, wait_for, waiting

pytestmark = pytest.mark.faults

#: The shortest lease there is (LEASE_SECONDS >= 5), swept every second: a killed worker's jobs run again ~6 s on.
SHORT_LEASE = {"LEASE_SECONDS": "5", "UNACKED_RESTORE_INTERVAL": "1"}
QUEUE = "default"  # test.run and test.ledger: the fan-out's items and its join
#: How long Redis stays down after the items running at the stop have ended.
OUTAGE_AFTER_S = 1.0


@dataclass
class Rig:
    broker: RedisServer
    ledger: RedisServer
    flows: FlowClient
    env: dict[str, str]

    def runs(self, key: str) -> list[dict[str, Any]]:
        """What `test.run` recorded for `key` (`tests.support.worker_app.run_records`, from the ledger)."""
        return [json.loads(x) for x in self.ledger.client().lrange(f"test:run:{key}", 0, -1)]

    def join_runs(self, key: str, n: int) -> tuple[int, int]:
        """(starts, completions) of the join that was given `n` results."""
        client = self.ledger.client()
        return int(client.llen(f"test:ledger:{key}:join:{n}")), int(client.llen(f"test:done:{key}:join:{n}"))

    def state(self, flow_id: str) -> str | None:
        try:
            value = self.broker.client().hget(f"pipeline:flow:{{{flow_id}}}", "state")
        except redis.RedisError:  # Redis is being restarted
            return None
        return value.decode() if value else None

    def tasks(self, flow_id: str) -> dict[str, str]:
        raw = self.broker.client().hgetall(f"pipeline:flow:{{{flow_id}}}:tasks")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def settled(self, queues: tuple[str, ...] = (QUEUE,)) -> bool:
        """Nothing queued, held or leased: no job of the flow can run (again) from here on."""
        client = self.broker.client()
        idle = client.hlen(UNACKED_KEY) == 0 and client.hlen(LEASE_KEY) == 0
        return idle and all(waiting(client, q) == 0 for q in queues)

    def succeeded(self, flow_id: str, timeout: float, queues: tuple[str, ...] = (QUEUE,)) -> dict[str, Any]:
        """Wait for the flow to succeed and every job of it to be acknowledged; its status then."""
        wait_for(lambda: self.state(flow_id) == "succeeded", timeout, 0.05, what=f"flow {flow_id} to succeed")
        wait_for(lambda: self.settled(queues), 15, 0.05, what="the last acknowledgements")
        return self.flows.status(flow_id)

    def assert_joined_once(self, flow_id: str, key: str, n: int) -> dict[str, Any]:
        """The fan-out's `n` items all finished at least once and are recorded, the flow succeeded, the join ran
        once with the `n` results, nothing was dead-lettered; the flow's status."""
        status = self.succeeded(flow_id, 60)
        split, join = status["steps"]
        assert (status["state"], status["failed_step"]) == ("succeeded", None)
        assert (split["jobs"], split["counts"]) == (n, {"succeeded": n})
        assert (join["jobs"], join["counts"]) == (1, {"succeeded": 1})
        items = {node: task_id for node, task_id in self.tasks(flow_id).items() if node.startswith("split[")}
        finished = {r["task_id"] for r in self.runs(key) if r["event"] == "finish"}
        assert len(items) == n and set(items.values()) <= finished, "an item never ran to its finish"
        assert self.join_runs(key, n) == (1, 1), f"the join with {n} results ran {self.join_runs(key, n)} times"
        joins = {k.decode() for k in self.ledger.client().keys(f"test:ledger:{key}:join:*")}
        assert joins == {f"test:ledger:{key}:join:{n}"}, f"a join ran with other than {n} results: {joins}"
        client = self.broker.client()
        assert waiting(client, DEAD_LETTER_QUEUE) == 0 and client.zcard(DLQ_INDEX_KEY) == 0, "dead-lettered"
        return status


@pytest.fixture
def rig(own_redis: RedisServer, ledger_redis: RedisServer) -> Iterator[Rig]:
    env = {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger_redis.url, **SHORT_LEASE}
    with FlowClient(own_redis.url) as flows:
        yield Rig(own_redis, ledger_redis, flows, env)


def start_workers(make_worker: Any, names: list[str], env: dict[str, str], **kwargs: Any) -> list[Worker]:
    """Workers booted side by side (each `make_worker` waits for its own to be ready)."""
    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(lambda name: make_worker(name, env=env, **kwargs), names))


def discard(workers: list[Worker]) -> None:
    """The scenario is over: its workers are killed rather than shut down (a clean shutdown costs seconds and is
    tested elsewhere); `make_worker` then finds them gone."""
    for worker in workers:
        worker.kill_group(signal.SIGKILL)
    for worker in workers:
        worker.wait(10)


def _finished(rig: Rig, key: str) -> int:
    return sum(r["event"] == "finish" for r in rig.runs(key))


def started_on(rig: Rig, key: str, worker: Worker) -> set[str]:
    """The items (task ids) that started on `worker`."""
    return {r["task_id"] for r in rig.runs(key) if r["event"] == "start" and r["node"].startswith(f"{worker.name}@")}


def test_parents_finishing_at_the_same_instant_on_two_workers_queue_the_join_once(rig: Rig, make_worker: Any) -> None:
    """120 items on two workers of two pool processes each: the first four are held and released together, the
    rest finish as soon as they start, four at a time, on both workers."""
    key, n = uuid.uuid4().hex, 120
    a, b = start_workers(make_worker, [f"same-a-{key[:6]}", f"same-b-{key[:6]}"], rig.env, queues=QUEUE)
    flow_id = rig.flows.start("test_fan", {"key": key, "n": n, "ends": "release"})
    wait_for(lambda: started_on(rig, key, a) and started_on(rig, key, b), 30, 0.02, what="items on both workers")
    wait_for(lambda: len(rig.runs(key)) >= 4, 30, 0.02, what="four items held at once")
    rig.ledger.client().set(f"test:release:{key}", "1")
    rig.assert_joined_once(flow_id, key, n)
    finishers = collections.Counter(r["node"].split("@")[0] for r in rig.runs(key) if r["event"] == "finish")
    assert set(finishers) == {a.name, b.name}, finishers
    discard([a, b])


#: Each pool, with how many items its two workers run at once. A solo worker records its items' nodes with the
#: next fetch (`pipeline.delivery.acks`), a prefork child with its job's result (`flow_advance.lua`).
POOLS = [("prefork", 4), ("solo", 2)]


@pytest.mark.parametrize(("pool", "running"), POOLS)
def test_a_worker_killed_with_items_in_flight_leaves_them_to_its_peer_and_the_join_runs_once(
    rig: Rig, make_worker: Any, pool: str, running: int
) -> None:
    key, n = uuid.uuid4().hex, 10
    names = [f"kill-a-{key[:6]}", f"kill-b-{key[:6]}"]
    victim, peer = start_workers(make_worker, names, rig.env, queues=QUEUE, pool=pool)
    flow_id = rig.flows.start("test_fan", {"key": key, "n": n, "ends": "release"})
    wait_for(lambda: len(started_on(rig, key, victim)) >= running // 2, 30, 0.02, what="items running on the victim")
    in_flight = started_on(rig, key, victim)
    victim.kill_group(signal.SIGKILL)
    victim.wait(10)
    rig.ledger.client().set(f"test:release:{key}", "1")
    rig.assert_joined_once(flow_id, key, n)
    finishes = [r for r in rig.runs(key) if r["event"] == "finish"]
    assert not [r for r in finishes if r["node"].startswith(f"{victim.name}@")], "the killed worker finished one"
    assert in_flight <= {r["task_id"] for r in finishes}, "an item in flight on the killed worker never finished"
    assert peer.proc is not None and peer.proc.poll() is None
    discard([peer])


@pytest.mark.parametrize(("pool", "running"), POOLS)
def test_a_redis_restart_in_the_middle_of_the_fan_out_queues_the_join_once(
    rig: Rig, make_worker: Any, pool: str, running: int
) -> None:
    """Items are running when Redis stops (four on prefork, two on solo); they finish while it is down and their
    advance waits for Redis (its calls are retried for up to 30 s; a solo worker's nodes ride a fetch that gets no
    answer: their jobs are delivered again); the rest, dropped with the connection or still queued, run after the
    restart. A pool process's first advance builds the join's message template with a publish through kombu, which
    raises kombu's own `OperationalError` while Redis is down: that too is waited out, not dead-lettered."""
    key, n = uuid.uuid4().hex, 16
    names = [f"restart-a-{key[:6]}", f"restart-b-{key[:6]}"]
    workers = start_workers(make_worker, names, rig.env, queues=QUEUE, pool=pool)
    flow_id = rig.flows.start("test_fan", {"key": key, "n": n, "ends": "release"})
    wait_for(lambda: len(rig.runs(key)) >= running, 30, 0.02, what="items running")
    rig.broker.stop()
    try:
        rig.ledger.client().set(f"test:release:{key}", "1")
        wait_for(lambda: _finished(rig, key) >= running, 30, 0.05, what="items ending in the outage")
        time.sleep(OUTAGE_AFTER_S)  # the outage itself, not a wait for an outcome: their advance waits for Redis
    finally:
        rig.broker.start()
    rig.assert_joined_once(flow_id, key, n)
    finished = collections.Counter(r["task_id"] for r in rig.runs(key) if r["event"] == "finish")
    assert set(finished.values()) == {1}, f"an item finished more than once: {finished}"  # none re-run for its record
    for worker in workers:
        assert worker.proc is not None and worker.proc.poll() is None, f"{worker.name} exited:\n{worker.log()[-3000:]}"
    discard(workers)


def test_advance_called_at_once_for_every_item_and_again_queues_the_join_once(rig: Rig) -> None:
    """`launch.advance` (one `flow_advance.lua` call) for each of 60 items, three times each, from 8 threads released
    together: each item is recorded once, the join is queued by exactly one call; called again afterwards (a
    redelivered parent), nothing changes. No worker: the queue holds what was queued."""
    key, n = uuid.uuid4().hex, 60
    flow_id = rig.flows.start("test_fan", {"key": key, "n": n})
    replies = rig.flows.race(flow_id, copies=3, threads=8)
    assert len(replies) == 3 * n
    recorded = collections.Counter(r["node"] for r in replies if r["recorded"])
    assert recorded == collections.Counter({f"split[{i}]": 1 for i in range(n)})
    assert [r["queued"] for r in replies if r["queued"]] == [["join"]]
    again = rig.flows.race(flow_id, copies=1, threads=4)
    assert [r for r in again if r["recorded"] or r["queued"]] == []

    client = rig.broker.client()
    steps = collections.Counter(
        json.loads(raw)["headers"]["pipeline_flow"]["step"]
        for k in queue_keys(QUEUE)
        for raw in client.lrange(k, 0, -1)
    )
    assert steps == {"split": n, "join": 1}
    flow = {k.decode(): v.decode() for k, v in client.hgetall(f"pipeline:flow:{{{flow_id}}}").items()}
    assert (flow["done"], flow["total"], flow["more:split"], flow["left"]) == (str(n), str(n + 1), "0", "0")
    assert client.scard(f"pipeline:flow:{{{flow_id}}}:wait:join") == 0


def test_a_parent_run_twice_and_redelivered_after_the_flow_finished_queues_the_join_once(
    rig: Rig, make_worker: Any
) -> None:
    """Each item's message is published twice before any worker runs (a second copy under a new delivery tag, as a
    producer's retry would), so two copies of a parent can run and finish at once; once the flow has succeeded,
    every item's original message is put back as a lease restore puts back a job whose acknowledgement was lost
    (its delivery counted once and never acknowledged, so this delivery is its second). The late copies find their
    node recorded: they run nothing and queue nothing."""
    key, n = uuid.uuid4().hex, 12
    flow_id = rig.flows.start("test_fan", {"key": key, "n": n, "sleep_s": 0.2})
    client = rig.broker.client()
    originals = [(k, raw) for k in queue_keys(QUEUE) for raw in client.lrange(k, 0, -1)]
    assert len(originals) == n
    for list_key, raw in originals:
        copy = json.loads(raw)
        copy["properties"]["delivery_tag"] = str(uuid.uuid4())
        client.lpush(list_key, json.dumps(copy))
    workers = start_workers(make_worker, [f"twice-a-{key[:6]}", f"twice-b-{key[:6]}"], rig.env, queues=QUEUE)
    rig.assert_joined_once(flow_id, key, n)
    before = len(rig.runs(key))

    for list_key, raw in originals:
        client.hset(DELIVERIES_KEY, json.loads(raw)["properties"]["delivery_tag"], 1)  # what a lost ack leaves
        client.lpush(list_key, raw)
    wait_for(lambda: rig.settled(), 30, 0.05, what="the redelivered items to be acknowledged")
    assert len(rig.runs(key)) == before, "a redelivered item whose node was recorded ran again"
    assert rig.join_runs(key, n) == (1, 1)
    stood = sum(w.log().count("had finished; its recorded result stands") for w in workers)
    assert stood >= n, f"{stood} copies found their node recorded (the {n} late ones at least)"
    discard(workers)


# The shipped media flow under a `kill -9` of its transcode worker.

SECRET = TEST_ENV["WEBHOOK_SIGNING_SECRET"].encode()
PRESETS = ["720p", "480p", "audio"]


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    server = HttpPeer().start()
    yield server
    server.stop()


def descendants(pid: int) -> dict[int, str]:
    """The processes under `pid` (children, theirs, ...) by PID, with their names."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            parents[int(entry.name)] = (int(rest[1]), name)
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, name) in parents.items():
            if ppid == parent and child not in found:
                found[child] = name
                frontier.append(child)
    return found


def kill_tree(worker: Worker) -> None:
    """SIGKILL the worker, its pool and the ffmpeg processes they run (in sessions of their own), by PID; the worker
    is frozen first, so it starts no process between the look and the kill."""
    worker.kill_group(signal.SIGSTOP)
    tree = descendants(worker.pid)
    worker.kill_group(signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    worker.wait(10)


def test_the_media_flow_posts_one_webhook_with_three_renditions_when_a_transcode_worker_is_killed(
    rig: Rig, make_worker: Any, peer: HttpPeer, work_dir: Path
) -> None:
    key = uuid.uuid4().hex
    make_clip("flow-kill.mp4", 2.5)
    env = {**rig.env, "STORAGE_DIR": str(work_dir / f"flow-storage-{key[:8]}")}
    victim = make_worker(f"media-a-{key[:6]}", env=env, queues="transcode", concurrency=3)
    hook = f"/hook/{key}"
    flow_id = rig.flows.start(
        "media", {"source_uri": "flow-kill.mp4", "presets": PRESETS, "notify_url": peer.url(hook)}
    )

    def transcoding() -> int:
        return sum(name == "ffmpeg" for name in descendants(victim.pid).values())

    wait_for(lambda: transcoding() >= 2, 60, 0.01, what="the transcodes running on the first worker")
    kill_tree(victim)
    rescuer = make_worker(f"media-b-{key[:6]}", env=env, queues="transcode,webhooks", concurrency=3)
    wait_for(lambda: peer.received(hook), 90, 0.1, what="the webhook")
    status = rig.succeeded(flow_id, 30, queues=("transcode", "webhooks"))

    [request] = peer.received(hook)  # settled: no job of the flow is left to post again
    assert webhook_http.verify(SECRET, request.headers[webhook_http.SIGNATURE_HEADER], request.body)
    assert request.headers[webhook_http.EVENT_HEADER] == "media.transcoded"
    body = json.loads(request.body)
    renditions = body["payload"]["renditions"]
    assert [r["preset"] for r in renditions] == PRESETS
    for rendition in renditions:
        path = Path(urlsplit(rendition["uri"]).path)
        assert path.is_file() and path.stat().st_size == rendition["bytes"], rendition
    transcode, notify = status["steps"]
    assert transcode["counts"] == {"succeeded": 3} and notify["counts"] == {"succeeded": 1}
    items = [task_id for node, task_id in rig.tasks(flow_id).items() if node.startswith("transcode[")]
    redone = [t for t in items if f"media.transcode[{t}] succeeded" in rescuer.log()]
    assert redone, "no transcode was left to the second worker: the kill came too late"
    client = rig.broker.client()
    assert waiting(client, DEAD_LETTER_QUEUE) == 0 and client.zcard(DLQ_INDEX_KEY) == 0
    discard([rescuer])
