"""What Redis keeps of a finished job, and what is still read from it.

A typed job's SUCCESS is stored compact and lean (`pipeline.compat.results.lean_success`: no payload, no empty
traceback or children), and the call that stores it deletes the job's accepted-job record
(`pipeline/lua/parts/results.lua`); its status, the API and the job browser still give its task, queue, worker,
result and accepted time (from the queue's recent-jobs index), and a delayed job's ETA. A failed job keeps its record
and its arguments; a plain Celery task keeps Celery's `result_extended` fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.constants import JOB_RECORD_KEY, RECENT_JOBS_KEY
from pipeline.lua import script, source
from pipeline.status import JobState, job_status, job_statuses
from tasks.probe import probe
from tests.support.plain_tasks import add
from tests.support.procs import RedisServer, running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_redis(work_dir: Path) -> Iterator[RedisServer]:
    """A redis-server for the script tests alone (no worker of the session on it)."""
    yield from running(RedisServer(work_dir / "finished-redis"))


@pytest.fixture
def client(own_redis: RedisServer) -> Iterator[redis.Redis]:
    client = own_redis.client()
    client.flushdb()
    yield client
    client.close()


def stored(task_id: str) -> bytes:
    raw: bytes = get_app().backend.client.get(get_app().backend.get_key_for_task(task_id))
    return raw


def test_a_succeeded_jobs_record_is_dropped_and_its_status_reads_the_same(session_worker: Any) -> None:
    task_id = probe.enqueue({"message": "lean"})
    assert probe.result(task_id, timeout=30).message == "lean"
    broker = get_app().backend.client
    assert broker.get(JOB_RECORD_KEY.format(id=task_id)) is None
    raw = stored(task_id)
    meta = json.loads(raw)
    assert raw.startswith(b'{"status":"SUCCESS",') and b'", "' not in raw  # compact
    assert list(meta)[-1] == "task_id" and meta["task_id"] == task_id
    assert not {"args", "kwargs", "traceback", "children", "eta"} & set(meta)
    assert meta["name"] == "pipeline.probe" and meta["queue"] == "default" and meta["worker"]

    status = job_status(task_id)
    accepted = broker.zscore(RECENT_JOBS_KEY.format(queue="default"), task_id)
    assert status.state is JobState.SUCCEEDED and status.final and status.result == {**meta["result"]}
    assert status.task == "pipeline.probe" and status.queue == "default" and status.worker == meta["worker"]
    assert status.accepted_at is not None and accepted is not None
    assert abs(_epoch(status.accepted_at) - accepted) < 1e-3 and status.finished_at and status.eta is None
    assert job_statuses([task_id]) == [status]
    result = AsyncResult(task_id, app=get_app())
    assert result.successful() and result.name == "pipeline.probe" and result.args is None


def test_a_delayed_job_keeps_its_eta_once_its_record_is_gone(session_worker: Any) -> None:
    task_id = probe.enqueue({"message": "later"}, countdown=1)
    assert probe.result(task_id, timeout=30).message == "later"
    assert get_app().backend.client.get(JOB_RECORD_KEY.format(id=task_id)) is None
    status = job_status(task_id)
    assert status.state is JobState.SUCCEEDED and status.eta is not None and status.accepted_at is not None
    assert _epoch(status.eta) - _epoch(status.accepted_at) == pytest.approx(1, abs=0.5)


def test_a_failed_job_keeps_its_record_and_its_arguments(session_worker: Any) -> None:
    task_id = probe.enqueue({"message": "doomed", "fail": "permanent"})
    wait_for(lambda: job_status(task_id).state is JobState.DEAD_LETTERED, 30, 0.05, what="the job dead-lettered")
    assert get_app().backend.client.get(JOB_RECORD_KEY.format(id=task_id)) is not None
    meta = json.loads(stored(task_id))
    assert meta["status"] == "FAILURE" and meta["args"][0]["message"] == "doomed"
    assert job_status(task_id).accepted_at is not None


def test_a_plain_celery_task_keeps_celerys_extended_result(session_worker: Any) -> None:
    result = add.apply_async((2, 3), queue="default")
    assert result.get(timeout=30) == 5
    meta = json.loads(stored(result.id))
    assert meta["args"] == [2, 3] and meta["kwargs"] == {} and list(meta)[-1] == "task_id"
    assert AsyncResult(result.id, app=get_app()).args == [2, 3]


def _store(client: redis.Redis, key: str, value: str, tag: str = "", owner: str = "") -> Any:
    """`store.lua` on result `r-<id>`, its job's record declared."""
    record = JOB_RECORD_KEY.format(id=key.removeprefix("r-"))
    return script("store")(keys=[key, "pipeline:lease", record], args=[value, 60, tag, owner], client=client)


def test_the_store_that_writes_a_success_deletes_that_jobs_record_only(client: redis.Redis) -> None:
    """`store.lua` deletes the record it is given (`pipeline:job:<id>`) with a SUCCESS written in the compact
    encoding; any other state, encoding or a fenced store keeps it, and no other job's record is touched."""
    ids = ["ok", "started", "failed", "spaced", "fenced", "other"]
    client.mset({JOB_RECORD_KEY.format(id=i): "{}" for i in ids})
    client.hset("pipeline:lease", "tag-f", "peer")
    assert _store(client, "r-ok", '{"status":"SUCCESS","result":{"task_id":"other"},"task_id":"ok"}') == 1
    assert _store(client, "r-started", '{"status":"STARTED","result":null,"task_id":"started"}') == 1
    assert _store(client, "r-failed", '{"status":"FAILURE","result":null,"task_id":"failed"}') == 1
    assert _store(client, "r-spaced", '{"status": "SUCCESS", "result": 1, "task_id": "spaced"}') == 1
    assert _store(client, "r-fenced", '{"status":"SUCCESS","task_id":"fenced"}', "tag-f", "me") == -1
    left = [i for i in ids if client.exists(JOB_RECORD_KEY.format(id=i))]
    assert left == ["started", "failed", "spaced", "fenced", "other"]
    assert client.get("r-ok") and client.ttl("r-ok") > 0


def test_settle_drops_the_record_of_the_success_it_stores_with_the_acknowledgement(client: redis.Redis) -> None:
    keys = ["unacked", "unacked_index", "pipeline:lease", "pipeline:deliveries"]
    client.hset("unacked", "t1", "[]")
    client.zadd("unacked_index", {"t1": 1})
    client.hset("pipeline:lease", "t1", "me")
    client.hset("pipeline:deliveries", "t1", 1)
    client.set(JOB_RECORD_KEY.format(id="j1"), "{}")
    value = '{"status":"SUCCESS","result":1,"task_id":"j1"}'
    fenced = script("settle")(keys=[*keys, "r-j1"], args=["me", "hist:", 1, value, 60, "t1", "t1"], client=client)
    assert fenced == [] and client.get("r-j1") == value.encode()
    assert not client.exists(JOB_RECORD_KEY.format(id="j1"), "hist:t1") and not client.hexists("unacked", "t1")


def test_the_record_prefix_the_scripts_spell_out_is_the_job_record_key() -> None:
    for name in ("store", "settle", "fetch", "flow_advance"):
        assert f"'{JOB_RECORD_KEY.format(id='')}' .. id" in source(name).decode(), name


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
