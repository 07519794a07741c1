"""The producer's hot path (`pipeline.producer`): one enqueue is one round trip and subscribes to nothing,
its message is the one Celery builds, and `enqueue_many` validates a batch at once and records every job."""

from __future__ import annotations

import base64
import itertools
import json
import subprocess
import sys
from typing import Any

import pytest
from celery import signals
from celery.result import AsyncResult
from pydantic import TypeAdapter

from pipeline import lua, publish
from pipeline.broker import queue_keys
from pipeline.celery_app import get_app
from pipeline.errors import PayloadInvalid
from pipeline.producer import template, write
from pipeline.records import accepted_record
from pipeline.status import JobState, job_status
from tasks.probe import ProbeResult, probe
from tests.support.cli import run_cli
from tests.support.monitor import Monitor
from tests.support.procs import ROOT, RedisServer

pytestmark = pytest.mark.integration


def known(task_id: str) -> bool:
    """Recorded, or already succeeded (its SUCCESS drops the record, when a worker of the session ran it): never
    unknown."""
    return accepted_record(task_id) is not None or job_status(task_id).state is not JobState.UNKNOWN


def test_one_enqueue_is_one_round_trip_that_writes_record_and_message_and_subscribes_to_nothing(
    redis_server: RedisServer,
) -> None:
    probe.enqueue({"message": "warm"})  # the process's client, template and connection exist from here on
    with Monitor(redis_server.client()) as seen:
        task_id = probe.enqueue({"message": "one trip"})
    # A worker may already be running the job (its own connections mention the id too): what counts is what
    # the producer's connection sent.
    (store,) = [c for c in seen.mentioning(task_id) if c["command"].split()[:2] == ["EVALSHA", lua.sha("enqueue")]]
    producer = (store["client_address"], store["client_port"])
    mine = [c for c in seen.commands if (c["client_address"], c["client_port"]) == producer]
    assert [c["command"].split()[0] for c in mine] == ["EVALSHA"]  # one command: one round trip
    # The script's own commands follow its EVALSHA in MONITOR's feed, together (a worker's scripts can run before or
    # after it, never inside it).
    after = seen.commands[seen.commands.index(store) + 1 :]
    in_script = [c["command"].split()[0] for c in itertools.takewhile(lambda c: c["client_type"] == "lua", after)]
    assert in_script[:4] == ["SET", "ZADD", "ZREMRANGEBYRANK", "LPUSH"]
    if get_app().conf.task_send_sent_event:
        assert in_script[4:] == ["PUBLISH"]  # Flower's task-sent event, in the same call
    assert not [c for c in seen.mentioning(task_id) if "SUBSCRIBE" in c["command"].split()[0].upper()]
    assert known(task_id)


def test_results_are_read_from_the_store_without_a_subscription_at_publish(session_worker: Any) -> None:
    task_id = probe.enqueue({"message": "stored"})
    result = probe.result(task_id, timeout=30)
    assert isinstance(result, ProbeResult) and result.message == "stored" and result.attempt == 1
    assert AsyncResult(task_id, app=get_app()).get(timeout=10)["message"] == "stored"
    assert job_status(task_id).state == JobState.SUCCEEDED


@pytest.mark.parity
def test_a_templated_message_is_byte_for_byte_the_one_celery_builds(redis_server: RedisServer) -> None:
    payload = probe.validate({"message": "héllo 'quoted' \"too\"", "sleep_s": 0.5}).model_dump(mode="json")
    text = json.dumps(payload)
    tpl = template.template_for(probe.name, lambda p, i, d, h: probe._send(p, i, d, h, None))
    task_id, published = "6f1c1a52-3a0e-4d55-9d35-2a54b1f1e0c7", 1234.5
    celery = publish.capture(
        lambda producer: probe._send(producer, task_id, payload, {"pipeline_published_at": published}, None)
    )
    limits = template.ReprLimits.of_app()
    job = template.Job(task_id, text, template.args_repr(payload, limits), published, task_id, None, "t1", "t2")
    ours = tpl.message(job, get_app().thread_oid)
    expected = json.loads(celery.body)
    expected["properties"]["delivery_tag"] = "t1"  # kombu's random tag: the only field that differs
    assert ours == json.dumps(expected)
    assert tpl.dest == celery.dest
    if celery.extra:  # the task-sent event: the same fields as Celery's, clock and time aside
        (_, (channel, raw)), event = celery.extra[0], tpl.sent_event(job, 7, 99.5)
        assert event is not None and event[0] == channel
        theirs, mine = (json.loads(base64.b64decode(json.loads(r)["body"])) for r in (raw, event[1]))
        assert mine == {**theirs, "clock": 7, "timestamp": 99.5}


def _enqueue_writes(commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The writes of an enqueue among the commands MONITOR saw: the enqueue script, a job record's SET, an LPUSH on
    the probe's queue, each sent by a client (not from inside a script). The session's worker, in this process when
    it runs one, shares the Redis: its own scripts (an acknowledgement, a result) are not an enqueue's."""
    queue = probe.queue
    writes = []
    for command in commands:
        words = command["command"].split()
        if command.get("client_type") == "lua" or not words:
            continue
        name, key = words[0].upper(), words[1].strip('"') if len(words) > 1 else ""
        if (
            (name in ("EVALSHA", "EVAL") and lua.sha("enqueue") in command["command"])
            or (name == "SET" and key.startswith("pipeline:job:"))
            or (name == "LPUSH" and key.startswith(queue))
        ):
            writes.append(command)
    return writes


def test_enqueue_many_validates_the_batch_in_one_call_and_names_the_bad_index(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    validate = TypeAdapter.validate_python

    def counting(self: TypeAdapter[Any], items: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(items))
        return validate(self, items, *args, **kwargs)

    monkeypatch.setattr(TypeAdapter, "validate_python", counting)
    good = {"message": "fine"}
    with Monitor(redis_server.client()) as seen, pytest.raises(PayloadInvalid) as err:
        probe.enqueue_many([good, good, good, {"message": "x", "sleep_s": -1}, good])
    assert calls == [5]
    assert [e["loc"] for e in err.value.errors] == [[3, "sleep_s"]]
    assert "3.sleep_s" in str(err.value)
    assert not _enqueue_writes(seen.commands), "an invalid batch wrote something"

    with pytest.raises(PayloadInvalid) as err:
        probe.enqueue_many([good, "not an object"])
    assert [e["loc"] for e in err.value.errors] == [[1]]


def test_enqueue_many_records_every_job_and_every_job_runs(session_worker: Any) -> None:
    ids = probe.enqueue_many([{"message": f"bulk {i}"} for i in range(25)])
    assert len(set(ids)) == 25
    assert all(known(i) for i in ids)
    assert [probe.result(i, timeout=30).message for i in ids] == [f"bulk {i}" for i in range(25)]


def test_enqueue_many_writes_each_chunk_in_one_round_trip(redis_server: RedisServer) -> None:
    probe.enqueue({"message": "warm"})
    with Monitor(redis_server.client()) as seen:
        ids = write.enqueue_many(
            probe.name, probe.queue, probe._send, TypeAdapter(list[probe.payload_model]), [{}] * 25, 10
        )
    calls = [c for c in seen.commands if c["command"].startswith(f"EVALSHA {lua.sha('enqueue')}")]
    assert [sum(i in c["command"] for i in ids) for c in calls] == [10, 10, 5]  # one call per chunk
    pushed = [c for c in seen.commands if c["client_type"] == "lua" and c["command"].startswith("LPUSH ")]
    assert sum(any(i in c["command"] for i in ids) for c in pushed) == 25
    assert all(known(i) for i in ids)


def test_the_cli_enqueues_a_batch_or_names_the_bad_item(session_worker: Any) -> None:
    lines = "\n".join(json.dumps({"message": f"line {i}"}) for i in range(3))
    done = run_cli("enqueue-many", "probe", lines, "--json")
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout)["ids"]
    assert [probe.result(i, timeout=30).message for i in ids] == ["line 0", "line 1", "line 2"]

    refused = run_cli("enqueue-many", "probe", json.dumps([{"message": "ok"}, {"message": 7}]), "--json")
    assert refused.returncode == 2
    assert [e["loc"] for e in json.loads(refused.stdout)["details"]] == [[1, "message"]]


def test_a_publish_hook_sees_every_job_when_one_is_connected(redis_server: RedisServer) -> None:
    """A foreign `before_task_publish` receiver (tracing, auditing) makes Celery build each job, so it runs."""
    seen_ids: list[str] = []

    def hook(headers: dict[str, Any] | None = None, **_: Any) -> None:
        assert headers is not None
        seen_ids.append(headers["id"])
        headers["x-audit"] = "seen"

    signals.before_task_publish.connect(hook, weak=False)
    try:
        one = probe.enqueue({"message": "hooked"})
        many = probe.enqueue_many([{"message": "hooked"}] * 3)
    finally:
        signals.before_task_publish.disconnect(hook)
    assert seen_ids == [one, *many]
    assert all(known(i) for i in [one, *many])
    client = redis_server.client()
    stored = [json.loads(m) for key in queue_keys("default") for m in client.lrange(key, 0, -1)]
    mine = {m["headers"]["id"]: m["headers"] for m in stored if m["headers"]["id"] in seen_ids}
    for headers in mine.values():  # those no worker has taken yet carry the hook's header and the stamp
        assert headers["x-audit"] == "seen" and headers["pipeline_published_at"] > 0


FORK_SCRIPT = """
import os, sys
from pipeline.producer.client import producer_redis
from tasks.probe import probe
from pipeline.records import accepted_record
from pipeline.status import job_status
def known(job):  # recorded, or succeeded already (its SUCCESS drops the record): never unknown
    return accepted_record(job) is not None or job_status(job).state.value != "unknown"
first = probe.enqueue({"message": "parent"})
parent_client = producer_redis()
pid = os.fork()
if pid == 0:  # the child: its own client, its jobs recorded
    job = probe.enqueue({"message": "child"})
    ok = producer_redis() is not parent_client and known(job)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
after = probe.enqueue({"message": "parent again"})
assert producer_redis() is parent_client and known(after)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_builds_its_own_client_and_the_parent_keeps_its_own(redis_server: RedisServer) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0"


def test_a_job_enqueued_by_a_running_job_names_it_as_its_parent(session_worker: Any) -> None:
    from tests.support.worker_app import spawn

    parent = spawn.enqueue({"message": "from a job"})
    child = spawn.result(parent, timeout=30).child_id
    assert probe.result(child, timeout=30).message == "from a job"
    assert get_app().backend.get_task_meta(child).get("parent_id") == parent  # as Celery's own publish sets it
