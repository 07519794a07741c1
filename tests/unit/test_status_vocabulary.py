"""One vocabulary of job states and one DLQ row, shared by the CLI, the API and the page; filters without typer."""

from __future__ import annotations

import ast
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pipeline.api.models import Accepted
from pipeline.control.flows import FlowState
from pipeline.dlq import filters, store
from pipeline.dlq.envelope import DeadLetter, DeadLetterRow
from pipeline.status import CELERY_STATES, FAILED_GRACE_S, JobState, JobStatus, is_final

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"


def test_the_states_in_the_order_a_job_moves_through_them() -> None:
    assert [s.value for s in JobState] == [
        "unknown", "scheduled", "queued", "started", "progress", "retrying", "succeeded", "failed", "dead_lettered",
        "cancelled",
    ]  # fmt: skip
    assert {s for s in JobState if s.final} == {
        JobState.SUCCEEDED, JobState.DEAD_LETTERED, JobState.CANCELLED, JobState.UNKNOWN
    }  # fmt: skip
    assert CELERY_STATES["REVOKED"] is JobState.CANCELLED  # what a cancel stores: not failed, not dead-lettered
    assert set(CELERY_STATES.values()) <= set(JobState)


def test_failed_is_final_once_no_dead_letter_entry_followed_within_the_grace() -> None:
    now = datetime.now(UTC)
    just = (now - timedelta(seconds=1)).isoformat()
    long_ago = (now - timedelta(seconds=FAILED_GRACE_S + 1)).isoformat()
    assert not is_final(JobState.FAILED, just, now)
    assert is_final(JobState.FAILED, long_ago, now)
    assert is_final(JobState.FAILED, long_ago.replace("+00:00", ""), now)  # naive means UTC
    assert not is_final(JobState.RETRYING, long_ago, now)
    assert is_final(JobState.SUCCEEDED, None, now)


def test_the_status_json_keeps_the_fields_clients_read() -> None:
    status = JobStatus(id="x", state=JobState.QUEUED).model_dump(mode="json")
    assert status["state"] == "queued"
    assert set(status) == {
        "id", "state", "final", "task", "queue", "worker", "attempts", "progress", "result", "error",
        "accepted_at", "eta", "due_at", "finished_at", "dlq_id",
    }  # fmt: skip


def _compared_states(script: str) -> set[str]:
    compared = set(re.findall(r'state [!=]== "(\w+)"', script))
    for listed in re.findall(r"\[([^\]]*)\]\.includes\(s\.state\)", script):
        compared |= set(re.findall(r'"(\w+)"', listed))
    return compared


def test_the_page_names_only_known_states_and_asks_the_status_whether_it_is_final() -> None:
    script = (PIPELINE / "api" / "static" / "app.js").read_text()
    compared = _compared_states(script)
    assert compared and compared <= {s.value for s in JobState}
    assert "status.final" in script
    assert "new Set([" not in script  # no state list of its own


def test_the_flows_script_names_only_job_and_flow_states_and_asks_the_flow_whether_it_is_final() -> None:
    script = (PIPELINE / "api" / "static" / "flows.js").read_text()
    compared = _compared_states(script)
    assert compared and compared <= {s.value for s in JobState} | {s.value for s in FlowState}
    assert "body.final" in script and "f.final" in script
    assert "new Set([" not in script


def test_the_dead_letter_row_is_one_model() -> None:
    entry = DeadLetter(reason="failed", task_name="email.send", task_id="t", args=[{}], exception_type="pkg.E")
    row = entry.row()
    assert isinstance(row, DeadLetterRow)
    assert row.model_dump(mode="json") == {
        "id": entry.id, "task_id": "t", "task": "email.send", "queue": None, "reason": "failed",
        "exception": "pkg.E", "message": "", "attempts": 1, "failed_at": entry.failed_at.isoformat(),
        "replayable": True, "flow": None,
    }  # fmt: skip
    header = {"flow": "invoice", "id": "f1", "step": "email", "item": None}
    assert entry.model_copy(update={"headers": {"pipeline_flow": header}}).row().flow == "invoice f1 email"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_api_imports_neither_typer_nor_the_cli() -> None:
    assert Accepted  # the package imports
    for path in (PIPELINE / "api").rglob("*.py"):
        bad = {n for n in _imports(path) if n == "typer" or n.startswith(("typer.", "pipeline.cli"))}
        assert not bad, (path, bad)


@pytest.mark.parametrize("text", ["soon", "", "1y", "99999999999999999999w"])
def test_bad_times_and_ages_are_bad_filters(text: str) -> None:
    with pytest.raises(filters.BadFilter):
        filters.parse_time(text)


def test_times_and_ages_for_filters() -> None:
    assert filters.parse_duration("12h") == timedelta(hours=12)
    assert filters.parse_time("2026-01-02T03:04:05") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert abs((datetime.now(UTC) - filters.parse_time("2d")) - timedelta(days=2)) < timedelta(seconds=5)


def test_an_element_that_is_not_an_envelope_is_indexed_by_its_digest() -> None:
    field, task_id = store.element_ids(b"not json at all")
    assert field.startswith("~") and task_id is None
    assert store.element_ids(b"not json at all") == (field, None)
