"""Durable enqueue on a replicated Redis (REDIS_WAIT_REPLICAS=1): every producer path returns only once the replica
holds its write, and fails with NotReplicated (the API a 503 with Retry-After, the CLI one line and exit 3) when the
replica does not confirm it within REDIS_WAIT_TIMEOUT_MS; a retry with the same idempotency key never makes a second
job.

The producer runs in a process of its own on the primary (`tests.support.replicas.ProducerProcess`); "does not
confirm" is a replica stopped with SIGSTOP, its link open. What the replica holds is read from the replica itself.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline import lua
from pipeline.broker import decode_message, queue_keys
from pipeline.constants import (
    DELAYED_KEY,
    DELAYED_MESSAGE_KEY,
    DLQ_INDEX_KEY,
    ENQUEUE_IDEMPOTENCY_KEY,
    HEADER_IDEMPOTENCY_KEY,
    JOB_RECORD_KEY,
)
from tests.support.api import ApiServer
from tests.support.monitor import Monitor
from tests.support.procs import wait_for
from tests.support.replicas import CallFailed, ProducerProcess, Replicated

pytestmark = pytest.mark.ha

TIMEOUT_MS = 400
ENV = {"REDIS_WAIT_REPLICAS": "1", "REDIS_WAIT_TIMEOUT_MS": str(TIMEOUT_MS)}
PROBE = "pipeline.probe"


@pytest.fixture(scope="module")
def redis_pair(work_dir: Path) -> Iterator[Replicated]:
    pair = Replicated(work_dir / f"replicated-{uuid.uuid4().hex[:8]}").start()
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def producer(redis_pair: Replicated, work_dir: Path) -> Iterator[ProducerProcess]:
    proc = ProducerProcess(work_dir / "logs" / "replicated-producer.log", {"REDIS_URL": redis_pair.url, **ENV})
    yield proc.start()
    proc.stop()


@pytest.fixture(scope="module")
def api(redis_pair: Replicated, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("replicated", work_dir / "logs", {"REDIS_URL": redis_pair.url, **ENV}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def queue(producer: ProducerProcess) -> str:
    return str(producer.call("queue", kind="probe"))


def messages(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The headers of every message waiting in `queue` (every priority level)."""
    return [decode_message(raw)["headers"] for key in queue_keys(queue) for raw in client.lrange(key, 0, -1)]


def ids_on(client: redis.Redis, queue: str) -> list[str]:
    return [h["id"] for h in messages(client, queue)]


def keyed(client: redis.Redis, queue: str, idempotency_key: str) -> list[str]:
    """Ids of the messages waiting in `queue` carrying this idempotency key."""
    return [h["id"] for h in messages(client, queue) if h.get(HEADER_IDEMPOTENCY_KEY) == idempotency_key]


def carrying(client: redis.Redis, queue: str, message: str) -> list[str]:
    """Ids of the messages waiting in `queue` whose payload's `message` is this one."""
    found = []
    for raw in (raw for key in queue_keys(queue) for raw in client.lrange(key, 0, -1)):
        envelope = decode_message(raw)
        if envelope["body"][0][0].get("message") == message:
            found.append(envelope["headers"]["id"])
    return found


def claim_holder(client: redis.Redis, idempotency_key: str) -> str | None:
    held = client.get(ENQUEUE_IDEMPOTENCY_KEY.format(task=PROBE, key=idempotency_key))
    return held.decode() if held is not None else None


def refused_in_time(failure: CallFailed) -> None:
    """A NotReplicated that took about REDIS_WAIT_TIMEOUT_MS (it waited, and no longer than it should)."""
    assert failure.kind == "NotReplicated", failure
    assert "replica" in failure.message and "REDIS_WAIT_REPLICAS" in failure.message
    assert TIMEOUT_MS / 1000 * 0.9 <= failure.elapsed <= TIMEOUT_MS / 1000 + 1.5, failure.elapsed


def test_an_enqueue_returns_once_the_replica_holds_it_in_one_round_trip(
    redis_pair: Replicated, producer: ProducerProcess, queue: str
) -> None:
    replica = redis_pair.replica.client()
    producer.call("enqueue", kind="probe", payload={"message": "warm"})  # template and connection built
    with Monitor(redis_pair.primary.client()) as seen:
        task_id = producer.call("enqueue", kind="probe", payload={"message": "durable"})
    # Read from the replica the moment the call returned: the record and the message are there.
    assert replica.get(JOB_RECORD_KEY.format(id=task_id)) is not None
    assert task_id in ids_on(replica, queue)
    (store,) = [c for c in seen.mentioning(task_id) if c["command"].split()[:2] == ["EVALSHA", lua.sha("enqueue")]]
    mine = [
        c
        for c in seen.commands
        if (c["client_address"], c["client_port"]) == (store["client_address"], store["client_port"])
    ]
    assert [c["command"].split()[:3] for c in mine] == [
        ["EVALSHA", lua.sha("enqueue"), "4"],
        ["WAIT", "1", str(TIMEOUT_MS)],
    ]

    batch = producer.call("enqueue_many", kind="probe", payloads=[{"message": f"b{i}"} for i in range(100)])
    assert len(batch) == 100
    on_replica = set(ids_on(replica, queue))
    assert set(batch) <= on_replica
    assert all(v is not None for v in replica.mget([JOB_RECORD_KEY.format(id=i) for i in batch]))


def test_a_replica_that_does_not_confirm_fails_every_enqueue_within_the_timeout(
    redis_pair: Replicated, producer: ProducerProcess, queue: str
) -> None:
    with redis_pair.frozen():
        for op, args in (
            ("enqueue", {"kind": "probe", "payload": {"message": "unconfirmed"}}),
            ("enqueue", {"kind": "probe", "payload": {"message": "unconfirmed"}, "countdown": 3600}),
            ("enqueue_many", {"kind": "probe", "payloads": [{"message": "u"}] * 10}),
        ):
            with pytest.raises(CallFailed) as failed:
                producer.call(op, **args)
            refused_in_time(failed.value)


@pytest.mark.parametrize("countdown", [None, 3600], ids=["due-now", "parked"])
def test_a_retry_with_the_same_key_after_not_replicated_answers_with_the_first_job(
    redis_pair: Replicated, producer: ProducerProcess, queue: str, countdown: int | None
) -> None:
    key = f"retry-{uuid.uuid4().hex}"
    call = {"kind": "probe", "payload": {"message": "once"}, "key": key, "countdown": countdown}
    with redis_pair.frozen():
        with pytest.raises(CallFailed) as failed:
            producer.call("enqueue", **call)
        refused_in_time(failed.value)
        first = claim_holder(redis_pair.primary.client(), key)
        assert first is not None, "the job and its claim are on the primary"
        with pytest.raises(CallFailed) as again:  # the first job is still unconfirmed: so is the answer
            producer.call("enqueue", **call)
        refused_in_time(again.value)
    assert producer.call("enqueue", **call) == first
    for client in (redis_pair.primary.client(), redis_pair.replica.client()):
        if countdown is None:
            assert keyed(client, queue, key) == [first]
        else:
            assert client.zscore(DELAYED_KEY, first) is not None and client.hget(DELAYED_MESSAGE_KEY, first)
            assert keyed(client, queue, key) == []
        assert claim_holder(client, key) == first


def test_the_api_answers_503_with_retry_after_and_a_retry_makes_one_job(
    redis_pair: Replicated, api: ApiServer, queue: str
) -> None:
    key = f"api-{uuid.uuid4().hex}"
    with api.client() as http:
        with redis_pair.frozen():
            started = time.monotonic()
            response = http.post("/jobs/probe", json={"message": "api"}, headers={"Idempotency-Key": key})
            assert time.monotonic() - started >= TIMEOUT_MS / 1000 * 0.9
            assert response.status_code == 503, response.text
            assert int(response.headers["Retry-After"]) > 0
            assert "replica" in response.json()["detail"]
            batch = http.post("/jobs/probe/batch", json=[{"message": "api"}] * 3)
            assert batch.status_code == 503 and "replica" in batch.json()["detail"]
            assert "Retry-After" in batch.headers
        retried = http.post("/jobs/probe", json={"message": "api"}, headers={"Idempotency-Key": key})
    assert retried.status_code == 202, retried.text
    job_id = retried.json()["id"]
    assert keyed(redis_pair.primary.client(), queue, key) == [job_id]
    assert keyed(redis_pair.replica.client(), queue, key) == [job_id]


def test_a_dlq_replay_waits_and_a_retried_replay_makes_one_job(
    redis_pair: Replicated, producer: ProducerProcess, api: ApiServer, queue: str
) -> None:
    primary, replica = redis_pair.primary.client(), redis_pair.replica.client()
    text = f"replayed-{uuid.uuid4().hex}"
    entry = producer.call("dead_letter", task=PROBE, payload={"message": text}, queue=queue)
    with redis_pair.frozen():
        with pytest.raises(CallFailed) as failed:
            producer.call("replay", ident=entry)
        refused_in_time(failed.value)
        by_cli = producer.call("cli", args=["dlq", "replay", entry, "--json"])
        with api.client() as http:
            by_api = http.post(f"/dlq/{entry}/replay")
        assert primary.hget(DLQ_INDEX_KEY, entry) is not None, "a replay not confirmed leaves the entry"
    assert by_cli["code"] == 3, by_cli
    (error,) = json.loads(by_cli["stdout"])["errors"]
    assert error["id"] == entry and "replica" in error["error"]
    assert by_api.status_code == 503 and "replica" in by_api.json()["detail"] and "Retry-After" in by_api.headers
    new_id = producer.call("replay", ident=entry)
    assert primary.hget(DLQ_INDEX_KEY, entry) is None
    for client in (primary, replica):
        assert carrying(client, queue, text) == [new_id], "four replays, one job"
        assert client.get(JOB_RECORD_KEY.format(id=new_id)) is not None


def test_the_cli_enqueue_waits_and_says_so_in_one_line(
    redis_pair: Replicated, producer: ProducerProcess, queue: str
) -> None:
    with redis_pair.frozen():
        human = producer.call("cli", args=["enqueue", "probe", '{"message": "cli"}'])
        machine = producer.call("cli", args=["enqueue", "probe", '{"message": "cli"}', "--json"])
    assert human["code"] == 3, human
    (line,) = human["stderr"].strip().splitlines()
    assert line.startswith("error: ") and "replica" in line
    assert machine["code"] == 3, machine
    assert "replica" in json.loads(machine["stdout"])["error"]
    done = producer.call("cli", args=["enqueue", "probe", '{"message": "cli"}'])
    assert done["code"] == 0, done
    assert done["stdout"].strip() in ids_on(redis_pair.replica.client(), queue)


def test_a_delayed_release_not_confirmed_is_logged_and_neither_lost_nor_doubled(
    redis_pair: Replicated, producer: ProducerProcess, queue: str
) -> None:
    primary, replica = redis_pair.primary.client(), redis_pair.replica.client()
    task_id = producer.call("enqueue", kind="probe", payload={"message": "parked"}, countdown=3600)
    assert replica.zscore(DELAYED_KEY, task_id) is not None
    with redis_pair.frozen():
        released, elapsed = producer.timed("release_due", now=time.time() + 3600)
        assert released >= 1
        assert elapsed >= TIMEOUT_MS / 1000 * 0.9, "the release waited for the replica"
        assert ids_on(primary, queue).count(task_id) == 1 and primary.zscore(DELAYED_KEY, task_id) is None
    assert "replica(s) confirmed it within" in producer.log()
    assert ids_on(replica, queue).count(task_id) == 1 and replica.zscore(DELAYED_KEY, task_id) is None
    assert producer.call("release_due", now=time.time() + 3600) == 0
    assert ids_on(primary, queue).count(task_id) == 1


#: The WAIT timeout of the producer whose WAIT the server cuts short: long, so the test finds the WAIT blocked and
#: tells an answer at the cut from one at the timeout however slow the machine is.
LONG_TIMEOUT_MS = 60_000


@pytest.fixture
def patient_producer(redis_pair: Replicated, work_dir: Path) -> Iterator[ProducerProcess]:
    env = {"REDIS_URL": redis_pair.url, **ENV, "REDIS_WAIT_TIMEOUT_MS": str(LONG_TIMEOUT_MS)}
    proc = ProducerProcess(work_dir / "logs" / "replicated-patient-producer.log", env)
    yield proc.start()
    proc.stop()


def test_a_wait_cut_short_by_the_server_is_not_replicated(
    redis_pair: Replicated, patient_producer: ProducerProcess
) -> None:
    """A primary demoted under a blocked WAIT answers it `-UNBLOCKED` (as CLIENT UNBLOCK ... ERROR does here): the
    enqueue is refused as not replicated at once, not reported as a broken connection or a server error."""
    producer = patient_producer
    primary = redis_pair.primary.client()
    producer.call("enqueue", kind="probe", payload={"message": "warm"})  # template and connection built
    outcome: dict[str, Any] = {}

    def enqueue() -> None:
        try:
            outcome["id"] = producer.call("enqueue", kind="probe", payload={"message": "unblocked"})
        except CallFailed as exc:
            outcome["error"] = exc

    with redis_pair.frozen():
        caller = threading.Thread(target=enqueue)
        caller.start()

        def blocked_in_wait() -> list[int]:
            return [int(c["id"]) for c in primary.client_list() if c["cmd"] == "wait" and "b" in c["flags"]]

        (client_id,) = wait_for(blocked_in_wait, 30, 0.005, what="the enqueue's WAIT")
        assert primary.execute_command("CLIENT", "UNBLOCK", client_id, "ERROR") == 1
        caller.join(10)
    failure = outcome.get("error")
    assert isinstance(failure, CallFailed) and failure.kind == "NotReplicated", outcome
    assert failure.elapsed < LONG_TIMEOUT_MS / 1000 / 2, "answered when unblocked, not at the timeout"
