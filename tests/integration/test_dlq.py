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

from pipeline.dlq import admin as dlq_admin
from pipeline.dlq import envelope as dlq
from tests.support.cli import run_cli
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


def test_replay_that_cannot_publish_leaves_the_entry(clean_dlq: None) -> None:
    entry = dlq.DeadLetter(reason="rejected", task_name=None, exception_type="ContentDisallowed")
    dlq.publish(entry)
    proc = cli("dlq", "replay", entry.id)
    assert proc.returncode == 1 and "no task and payload to replay" in proc.stderr
    assert [e.id for e in entries()] == [entry.id]


def test_purge_older_than_removes_only_old_entries(clean_dlq: None) -> None:
    old = dlq.DeadLetter(
        reason="failed",
        task_name="pipeline.probe",
        args=[{}],
        exception_type="X",
        failed_at=datetime.now(UTC) - timedelta(days=3),
    )
    new = dlq.DeadLetter(reason="failed", task_name="pipeline.probe", args=[{}], exception_type="X")
    dlq.publish(old)
    dlq.publish(new)
    proc = cli("dlq", "purge", "--older-than", "2d", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"removed": 1}
    assert [e.id for e in entries()] == [new.id]


def test_list_filters_and_show(clean_dlq: None) -> None:
    a = dlq.DeadLetter(
        reason="failed", task_name="email.send", args=[{}], exception_type="pkg.SMTPError", traceback="Traceback: boom"
    )
    b = dlq.DeadLetter(
        reason="failed",
        task_name="pdf.render",
        args=[{}],
        exception_type="pkg.BadPdf",
        failed_at=datetime.now(UTC) - timedelta(hours=5),
    )
    dlq.publish(a)
    dlq.publish(b)
    listed = json.loads(cli("dlq", "list", "--task", "email.*", "--json").stdout)
    assert [r["id"] for r in listed] == [a.id]
    assert [r["id"] for r in json.loads(cli("dlq", "list", "--exception", "BadPdf", "--json").stdout)] == [b.id]
    assert [r["id"] for r in json.loads(cli("dlq", "list", "--since", "1h", "--json").stdout)] == [a.id]
    shown = cli("dlq", "show", a.id)
    assert shown.returncode == 0 and "Traceback: boom" in shown.stdout
    assert cli("dlq", "show", "nope").returncode == 1


def test_retention_keeps_the_newest_entries(clean_dlq: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import config

    for i in range(5):
        dlq.publish(dlq.DeadLetter(reason="failed", task_name=f"t{i}", args=[{}], exception_type="X"))
    settings = config.get_settings().model_copy(update={"dlq_max_entries": 3})
    monkeypatch.setattr(dlq_admin, "get_settings", lambda: settings)
    assert dlq_admin.apply_retention() == 2
    assert [e.task_name for e in entries()] == ["t4", "t3", "t2"]


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
    task_id = ledger.enqueue({"key": "after-undecodable"})
    assert ledger.result(task_id, timeout=30).attempt == 1
