"""Poison input never takes a worker down, and the dead-letter queue is never consumed.

Every message here is one a foreign client or an operator could put on a queue: a body that is a JSON
object, headers without a task id, raw bytes, a body far over the size limit. Each lands in the DLQ with
its reason and a bounded preview, and the same worker process (same pid) then runs a good job. The
worker consumes a queue of its own ("poison"), so no other test's worker takes these messages.
"""

from __future__ import annotations

import hashlib
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.broker import queue_keys
from pipeline.celery_app import get_app
from pipeline.dlq import admin as dlq_admin
from pipeline.dlq.envelope import DeadLetter, publish
from tests.support.procs import RedisServer, Worker, wait_for
from tests.support.worker_app import attempts, ledger, ledger_client

pytestmark = pytest.mark.faults
QUEUE = "poison"
PREVIEW_LIMIT = 2048


def publish_task_message(body: Any, headers: dict[str, Any]) -> None:
    """A JSON message as a foreign client might send it: any body, any headers."""
    with get_app().connection_for_write() as conn:
        conn.Producer().publish(body, exchange="", routing_key=QUEUE, serializer="json", headers=headers)


def entries(reason: str | None = None) -> list[DeadLetter]:
    return [e for e in dlq_admin.list_entries() if reason is None or e.reason == reason]


def assert_good_job_runs(worker: Worker, pid: int) -> None:
    """The worker that took the poison is the same process and still runs jobs."""
    key = f"after-{uuid.uuid4().hex[:8]}"
    task_id = str(ledger.task.apply_async(({"key": key},), queue=QUEUE).id)
    assert ledger.result(task_id, timeout=30).key == key
    assert worker.proc is not None and worker.proc.poll() is None and worker.pid == pid
    assert len(attempts(key)) == 1  # ran once


def queue_empty() -> bool:
    client = ledger_client()
    return all(client.llen(k) == 0 for k in queue_keys(QUEUE))


@pytest.fixture
def poison_worker(make_worker: Any, clean_dlq: None) -> Worker:
    return make_worker("poison", queues=QUEUE, concurrency=1)


def test_malformed_task_messages_are_dead_lettered_and_the_worker_keeps_consuming(poison_worker: Worker) -> None:
    pid = poison_worker.pid
    object_id, no_id_key = str(uuid.uuid4()), f"no-id-{uuid.uuid4().hex[:8]}"
    publish_task_message({"key": "object-body", "note": "not a list"}, {"task": "test.ledger", "id": object_id})
    publish_task_message([[{"key": no_id_key}], {}, {}], {"task": "test.ledger"})
    wait_for(lambda: len(entries()) == 2, 30, what="two dead-letter entries")

    by_object = dlq_admin.get(object_id)
    assert by_object.reason == "rejected" and by_object.task_name == "test.ledger"
    assert by_object.exception_type == "pipeline.dlq.poison.MalformedMessage"
    assert "JSON object" in by_object.exception_message
    assert by_object.body_preview is not None and '"object-body"' in by_object.body_preview
    (no_id,) = [e for e in entries() if e.id != by_object.id]
    assert no_id.reason == "rejected" and "task id" in no_id.exception_message
    assert attempts("object-body") == [] and attempts(no_id_key) == []  # neither ran

    assert_good_job_runs(poison_worker, pid)
    assert queue_empty() and len(entries()) == 2  # sent 3: ran 1, dead-lettered 2, lost 0


def test_raw_bytes_in_a_queue_are_dead_lettered_as_undecodable(poison_worker: Worker) -> None:
    pid = poison_worker.pid
    garbage = b"\xff\xfe not json at all \x00" + b"x" * 10_000
    not_an_envelope = b'{"hello": "a JSON object that is not a kombu message"}'
    client = ledger_client()
    client.lpush(QUEUE, garbage)
    client.lpush(QUEUE, not_an_envelope)
    wait_for(lambda: len(entries("undecodable")) == 2, 30, what="two undecodable entries")

    by_size = {e.body_size: e for e in entries("undecodable")}
    raw = by_size[len(garbage)]
    assert raw.queue == QUEUE and raw.body_sha256 == hashlib.sha256(garbage).hexdigest()
    assert raw.body_preview is not None and len(raw.body_preview.encode()) <= PREVIEW_LIMIT * 2
    assert "not json at all" in raw.body_preview and not raw.replayable
    assert "hello" in (by_size[len(not_an_envelope)].body_preview or "")

    assert_good_job_runs(poison_worker, pid)
    assert queue_empty() and len(entries()) == 2


def test_an_oversized_message_gives_a_bounded_entry_and_no_stored_result(poison_worker: Worker) -> None:
    pid = poison_worker.pid
    task_id, key = str(uuid.uuid4()), f"big-{uuid.uuid4().hex[:8]}"
    blob = "z" * (4 * 1024 * 1024)
    publish_task_message([[{"key": key, "blob": blob}], {}, {}], {"task": "test.ledger", "id": task_id})
    entry = dlq_admin.get(task_id) if wait_for(lambda: entries(), 30, what="the entry") else None
    assert entry is not None and entry.reason == "rejected"
    assert entry.exception_type == "pipeline.dlq.poison.MessageTooLarge"
    assert entry.args is None and entry.body_size is not None and entry.body_size > len(blob)
    assert entry.body_preview is not None and len(entry.body_preview) <= PREVIEW_LIMIT
    stored = ledger_client().lrange("dead_letter", 0, -1)
    assert len(stored) == 1 and len(stored[0]) < 16 * 1024  # the entry is a preview, not a copy
    assert attempts(key) == []  # never ran
    assert ledger_client().exists(f"celery-task-meta-{task_id}") == 0  # no result stored

    assert_good_job_runs(poison_worker, pid)
    assert queue_empty() and len(entries()) == 1


def _seed_dead_letters(n: int) -> list[bytes]:
    for i in range(n):
        publish(DeadLetter(reason="failed", task_name="test.ledger", args=[{"key": f"seed-{i}"}], exception_type="X"))
    return list(ledger_client().lrange("dead_letter", 0, -1))


def test_a_worker_asked_to_consume_the_dlq_refuses_to_start(
    services: None, clean_dlq: None, redis_server: RedisServer, work_dir: Path
) -> None:
    before = _seed_dead_letters(3)
    worker = Worker("dlq-consumer", work_dir / "logs", {}, queues=f"{QUEUE},dead_letter", concurrency=1)
    try:
        with pytest.raises(RuntimeError, match="exited at start"):
            worker.start()
        assert worker.proc is not None and worker.proc.wait(10) == 2
        refusals = [line for line in worker.log().splitlines() if "refusing to start" in line]
        assert len(refusals) == 1 and "'dead_letter'" in refusals[0]
    finally:
        worker.stop()
    assert list(redis_server.client().lrange("dead_letter", 0, -1)) == before  # count and content


def test_a_running_worker_refuses_to_add_the_dlq(poison_worker: Worker) -> None:
    before = _seed_dead_letters(2)
    control, node = get_app().control, [f"poison@{socket.gethostname()}"]
    wait_for(lambda: control.ping(destination=node, timeout=1), 60, what="the worker to answer control commands")
    assert control.add_consumer("dead_letter", destination=node, reply=True, timeout=5)
    wait_for(lambda: "add_consumer ignored" in poison_worker.log(), 10, what="the refusal")
    assert_good_job_runs(poison_worker, poison_worker.pid)
    assert list(ledger_client().lrange("dead_letter", 0, -1)) == before


def test_an_envelope_that_reaches_a_worker_goes_back_unchanged(poison_worker: Worker) -> None:
    """Defence in depth: a DLQ envelope delivered to a worker anyway is neither run nor dead-lettered again."""
    before = _seed_dead_letters(3)
    client = ledger_client()
    client.lmove("dead_letter", QUEUE, "RIGHT", "LEFT")  # the oldest envelope, onto a queue the worker consumes
    # The line this refusal logs, not the add_consumer one: every `poison` worker of the session logs to one file.
    wait_for(lambda: "its envelopes are left in place" in poison_worker.log(), 60, 0.1, what="the refusal")
    wait_for(lambda: client.llen("dead_letter") == 3, 10, what="the envelope to be back")
    assert list(client.lrange("dead_letter", 0, -1)) == before  # same place, same bytes, nothing nested
    assert all(dlq_admin.get(e.id).id == e.id for e in entries())  # the index still finds every entry
    assert_good_job_runs(poison_worker, poison_worker.pid)
    assert queue_empty() and len(entries()) == 3
