"""The dead-letter queue: replay, purge, and messages the worker refuses (pickle, unknown task, bad body)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange

from pipeline.broker import broker_redis
from pipeline.dlq import admin as dlq_admin
from pipeline.dlq import envelope as dlq
from pipeline.dlq import store
from pipeline.publish import capture_many
from pipeline.status import JobState, job_status
from tests.support.cli import run_cli
from tests.support.dlq import dead_letter
from tests.support.procs import wait_for
from tests.support.worker_app import attempts, ledger, ledger_client

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def entries(**filters: Any) -> list[dlq_admin.DeadLetter]:
    return dlq_admin.list_entries(dlq_admin.Filters(**filters))


def wait_for_entry(**match: Any) -> dlq_admin.DeadLetter:
    def find() -> dlq_admin.DeadLetter | None:
        for entry in dlq_admin.list_entries():
            if all(getattr(entry, k) == v for k, v in match.items()):
                return entry
        return None

    found = wait_for(find, 30, 0.1, what=f"dead-letter entry {match}")
    assert isinstance(found, dlq_admin.DeadLetter)
    return found


def assert_index_matches_the_list() -> None:
    """The index names exactly the entries in the list, and every task pointer names one of them."""
    with broker_redis() as client:
        listed = [store.element_ids(raw) for raw in client.lrange("dead_letter", 0, -1)]
        index = {k.decode(): v for k, v in client.hgetall("pipeline:dlq:index").items()}
        tasks = {k.decode(): v.decode() for k, v in client.hgetall("pipeline:dlq:tasks").items()}
    assert sorted(index) == sorted(field for field, _ in listed)
    assert tasks == {task: field for field, task in reversed(listed) if task}


def commands(name: str) -> int:
    """How many times Redis has run command `name` (from INFO commandstats)."""
    with broker_redis() as client:
        stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def test_replay_runs_the_job_again_and_removes_the_entry(session_worker: Any, clean_dlq: None) -> None:
    key = "replay-me"
    ledger_client().set(f"test:flag:{key}", 1)
    task_id = ledger.enqueue({"key": key, "fail": "flag"})
    entry = wait_for_entry(task_id=task_id)
    ledger_client().delete(f"test:flag:{key}")  # the cause is fixed

    proc = cli("dlq", "replay", entry.id, "--json")
    assert proc.returncode == 0, proc.stderr
    new_id = json.loads(proc.stdout)["replayed"][0]["new_task_id"]
    assert new_id != task_id
    assert ledger.result(new_id, timeout=30).key == key
    assert [e.id for e in entries()] == []
    assert ledger_client().lrange(f"test:done:{key}", 0, -1) == [new_id.encode()]
    assert dlq_admin.find(entry.id) is None and dlq_admin.find(task_id) is None
    assert ledger_client().hlen("pipeline:dlq:index") == ledger_client().hlen("pipeline:dlq:tasks") == 0


def test_replay_that_cannot_publish_leaves_the_entry(clean_dlq: None) -> None:
    entry = dlq.DeadLetter(reason="rejected", task_name=None, exception_type="ContentDisallowed")
    dlq.publish(entry)
    proc = cli("dlq", "replay", entry.id)
    assert proc.returncode == 1 and "no task and payload to replay" in proc.stderr
    assert [e.id for e in entries()] == [entry.id]


def _failed(task: str, exception: str, **fields: Any) -> dlq.DeadLetter:
    """An entry of a job of `task` that failed with `exception`, payload `{}`."""
    return dlq.DeadLetter(reason="failed", task_name=task, args=[{}], exception_type=exception, **fields)


def test_purge_older_than_removes_only_old_entries(clean_dlq: None) -> None:
    old = _failed("pipeline.probe", "X", failed_at=datetime.now(UTC) - timedelta(days=3))
    new = _failed("pipeline.probe", "X")
    dlq.publish(old)
    dlq.publish(new)
    proc = cli("dlq", "purge", "--older-than", "2d", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"removed": 1}
    assert [e.id for e in entries()] == [new.id]
    assert dlq_admin.find(old.id) is None and dlq_admin.get(new.id) == new
    assert_index_matches_the_list()


def test_list_filters_and_show(clean_dlq: None) -> None:
    a = _failed("email.send", "pkg.SMTPError", traceback="Traceback: boom")
    b = _failed("pdf.render", "pkg.BadPdf", failed_at=datetime.now(UTC) - timedelta(hours=5))
    dlq.publish(a)
    dlq.publish(b)
    listed = json.loads(cli("dlq", "list", "--task", "email.*", "--json").stdout)
    assert [r["id"] for r in listed] == [a.id]
    assert [r["id"] for r in json.loads(cli("dlq", "list", "--exception", "BadPdf", "--json").stdout)] == [b.id]
    assert [r["id"] for r in json.loads(cli("dlq", "list", "--since", "1h", "--json").stdout)] == [a.id]
    shown = cli("dlq", "show", a.id)
    assert shown.returncode == 0 and "Traceback: boom" in shown.stdout
    assert cli("dlq", "show", "nope").returncode == 1
    assert listed == [a.row().model_dump(mode="json")]  # the same rows as GET /dlq
    assert set(listed[0]) == set(dlq.DeadLetterRow.model_fields)
    bad_since = cli("dlq", "list", "--since", "soon")
    assert bad_since.returncode == 2 and "not a duration" in bad_since.stderr


def test_enqueue_wait_reports_a_dead_lettered_job_as_the_api_does(session_worker: Any, clean_dlq: None) -> None:
    proc = cli("enqueue", "probe", '{"message": "wait-dead", "fail": "permanent"}', "--wait", "--json")
    assert proc.returncode == 1, proc.stderr
    status = json.loads(proc.stdout)
    assert status["state"] == "dead_lettered" and status["final"] is True
    assert status["dlq_id"] == dlq_admin.get(status["id"]).id
    assert status["error"]["type"] == "PermanentError"


def test_retention_keeps_the_newest_entries(clean_dlq: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import config

    published = [dlq.DeadLetter(reason="failed", task_name=f"t{i}", args=[{}], exception_type="X") for i in range(5)]
    for entry in published:
        dlq.publish(entry)
    settings = config.get_settings().model_copy(update={"dlq_max_entries": 3})
    monkeypatch.setattr(dlq_admin, "get_settings", lambda: settings)
    assert dlq_admin.apply_retention() == 2
    assert [e.task_name for e in entries()] == ["t4", "t3", "t2"]
    assert [dlq_admin.find(e.id) for e in published] == [None, None, *published[2:]]
    assert_index_matches_the_list()


def test_publishing_past_the_retention_bound_trims_list_and_index_together(
    clean_dlq: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline import config

    settings = config.get_settings().model_copy(update={"dlq_max_entries": 3})
    monkeypatch.setattr(dlq, "get_settings", lambda: settings)
    published = [
        dlq.DeadLetter(reason="failed", task_name="t", task_id=f"task-{i}", args=[{}], exception_type="X")
        for i in range(5)
    ]
    for entry in published:
        dlq.publish(entry)
    assert [e.id for e in entries()] == [e.id for e in reversed(published[2:])]
    assert_index_matches_the_list()
    assert dlq_admin.find("task-1") is None and dlq_admin.find(published[1].id) is None
    assert dlq_admin.get("task-2") == published[2]


def test_show_and_delete_by_entry_or_task_id_through_the_index(clean_dlq: None) -> None:
    first = dlq.DeadLetter(reason="failed", task_name="email.send", task_id="job-a", args=[{}], exception_type="X")
    again = first.model_copy(update={"id": "second-entry", "exception_message": "again"})  # same task, dead again
    other = dlq.DeadLetter(reason="rejected", task_id="job-b", exception_type="ContentDisallowed")
    for entry in (first, again, other):
        dlq.publish(entry)
    assert_index_matches_the_list()
    assert dlq_admin.get("job-a") == again  # a task id names its newest entry
    assert dlq_admin.get(first.id) == first
    shown = cli("dlq", "show", "job-b", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == other.model_dump(mode="json")

    before = commands("lrange")
    assert json.loads(cli("dlq", "delete", first.id, "--json").stdout) == {"deleted": first.id}
    assert dlq_admin.get("job-a") == again  # removing the older entry keeps the task's pointer
    assert json.loads(cli("dlq", "delete", "job-a", "--json").stdout) == {"deleted": again.id}
    assert commands("lrange") == before  # found and removed without reading the list
    assert dlq_admin.find("job-a") is None
    assert cli("dlq", "delete", "job-a").returncode == 1
    assert [e.id for e in entries()] == [other.id]
    assert_index_matches_the_list()


def test_a_failed_jobs_status_reads_no_list_even_with_thousands_of_entries(
    session_worker: Any, clean_dlq: None
) -> None:
    task_id = ledger.enqueue({"key": "status-o1", "fail": "permanent"})
    entry = dead_letter(task_id)
    filler = [
        dlq.DeadLetter(
            reason="failed", task_name="t", task_id=f"filler-{i}", args=[{}], exception_type="X", traceback="x" * 2000
        ).model_dump(mode="json")
        for i in range(5000)
    ]
    sends = [
        (lambda producer, body=body: producer.publish(body, exchange="", routing_key="dead_letter", serializer="json"))
        for body in filler
    ]
    with broker_redis() as client:  # written as before the index existed: the list only
        client.lpush("dead_letter", *[m.body for m in capture_many(sends)])
        assert client.llen("dead_letter") == 5001

    before = commands("lrange")
    assert dlq_admin.get("filler-10").task_id == "filler-10"  # the first lookup builds the index, once
    assert commands("lrange") == before + 1
    assert_index_matches_the_list()

    before = {name: commands(name) for name in ("lrange", "lindex", "lpos", "lrem")}
    for i in range(20):
        status = job_status(task_id)
        assert status.state == JobState.DEAD_LETTERED and status.dlq_id == entry.id and status.final
        assert dlq_admin.get(f"filler-{i}").task_id == f"filler-{i}"
    assert {name: commands(name) for name in before} == before


class _Marker:
    """Unpickling this creates a file: proof that a worker deserialised pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Path(self.path).touch, ())


def test_pickle_message_is_refused_never_unpickled_and_dead_lettered(
    session_worker: Any, clean_dlq: None, redis_server: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    foreign = Celery(broker=redis_server.url)
    foreign.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    task_id = foreign.send_task(
        "test.ledger", args=[{"key": "pickled", "obj": _Marker(str(marker))}], queue="default"
    ).id
    entry = wait_for_entry(task_id=task_id)
    assert entry.reason == "rejected"
    assert entry.content_type == "application/x-python-serialize"
    assert entry.exception_type.endswith("ContentDisallowed")
    assert not entry.replayable
    assert not marker.exists()
    assert attempts("pickled") == []


def test_unknown_task_name_is_dead_lettered(session_worker: Any, clean_dlq: None) -> None:
    from pipeline.celery_app import get_app

    app = get_app()

    task_id = app.send_task("does.not.exist", args=[{"a": 1}], queue="default").id
    entry = wait_for_entry(task_id=task_id)
    assert entry.reason == "unknown_task" and entry.task_name == "does.not.exist"
    assert entry.exception_type == "celery.exceptions.NotRegistered"
    assert entry.payload == {"a": 1} and entry.replayable


def test_undecodable_body_is_dead_lettered_and_the_worker_keeps_consuming(
    session_worker: Any, clean_dlq: None, redis_server: Any
) -> None:
    with Connection(redis_server.url) as conn:
        conn.Producer().publish(
            b"{not json",
            exchange=Exchange("default", "direct"),
            routing_key="default",
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "test.ledger", "id": "undecodable-1", "lang": "py"},
        )
    entry = wait_for_entry(task_id="undecodable-1")
    assert entry.reason == "undecodable" and entry.body_preview == "{not json"
    assert dlq_admin.get("undecodable-1") == entry
    task_id = ledger.enqueue({"key": "after-undecodable"})
    assert ledger.result(task_id, timeout=30).attempt == 1
