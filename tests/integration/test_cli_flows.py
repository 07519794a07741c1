"""`pipeline flow ...` on the session's Redis and in-process worker: start (JSON, a file, the example) and follow a
flow, its status as a table and as JSON, the recent flows, a cancel; bad input, unknown flows and ids refused with the
exit codes of the job commands."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.procs import RedisServer, wait_for
from tests.support.worker_app import run_records

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("session_worker")]


def test_start_and_follow_a_fan_out_then_its_status_as_a_table_and_json(tmp_path: Path) -> None:
    key = uuid.uuid4().hex
    source = tmp_path / "input.json"
    source.write_text(json.dumps({"key": key, "n": 3}))
    started = run_cli("flow", "start", "test_fan", "--input-file", str(source), "--wait")
    assert started.returncode == 0, started
    flow_id = started.stderr.split()[-1]
    assert started.stderr.strip() == f"flow test_fan {flow_id}"
    lines = started.stdout.splitlines()
    assert lines[0] == f"flow test_fan {flow_id}"
    assert lines[1].startswith("state:    succeeded  [####################] 100.0 %")
    (split,) = [line for line in lines if line.startswith("split (each)")]
    assert split.split()[2:5] == ["succeeded", "3/3", "[####################]"]
    assert any(line.split()[:3] == ["join", "succeeded", "1/1"] for line in lines)

    shown = run_cli("flow", "status", flow_id, "--json")
    status = json.loads(shown.stdout)
    assert (status["state"], status["final"], status["input"]) == ("succeeded", True, {"key": key, "n": 3, **DEFAULTS})
    assert [s["counts"] for s in status["steps"]] == [{"succeeded": 3}, {"succeeded": 1}]
    assert run_cli("flow", "status", flow_id).stdout.splitlines() == lines
    watched = run_cli("flow", "status", flow_id, "--watch", "--json")  # final already: returns at once
    assert watched.returncode == 0 and json.loads(watched.stdout)["id"] == flow_id

    listed = json.loads(run_cli("flow", "list", "--flow", "test_fan", "--limit", "100", "--json").stdout)
    assert flow_id in [row["id"] for row in listed] and {row["flow"] for row in listed} == {"test_fan"}
    table = run_cli("flow", "list", "--flow", "test_fan").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "FLOW", "STATE", "PROGRESS"]
    assert any(line.startswith(f"{flow_id}  test_fan     succeeded    100.0%") for line in table), table


DEFAULTS = {"sleep_s": 0.0, "ends": "sleep"}


def test_start_without_wait_prints_the_id_and_a_chain_succeeds() -> None:
    key = uuid.uuid4().hex
    started = run_cli("flow", "start", "test_chain", json.dumps({"key": key}), "--json")
    assert started.returncode == 0, started
    accepted = json.loads(started.stdout)
    assert accepted["flow"] == "test_chain"
    watched = run_cli("flow", "status", accepted["id"], "--watch", "--json")
    assert watched.returncode == 0, watched
    assert [s["state"] for s in json.loads(watched.stdout)["steps"]] == ["succeeded", "succeeded"]
    plain = run_cli("flow", "start", "test_chain", json.dumps({"key": key}), "--idempotency-key", key)
    assert plain.returncode == 0 and str(uuid.UUID(plain.stdout.strip())) == plain.stdout.strip()
    again = run_cli("flow", "start", "test_chain", json.dumps({"key": key}), "--idempotency-key", key, "--json")
    assert json.loads(again.stdout) == {"id": plain.stdout.strip(), "flow": "test_chain"}  # the first flow, once


def test_the_invoice_flow_runs_with_its_example_input() -> None:
    done = run_cli("flow", "start", "invoice", "--example", "--wait", "--json", "--timeout", "120")
    assert done.returncode == 0, done
    status = json.loads(done.stdout)
    assert [(s["name"], s["task"], s["state"]) for s in status["steps"]] == [
        ("render", "pdf.render", "succeeded"),
        ("email", "email.send", "succeeded"),
    ]
    kinds = run_cli("flow", "kinds").stdout
    assert "invoice      render (pdf.render), email (email.send) after render\n" in kinds


def test_bad_input_unknown_flows_and_ids_are_refused_with_exit_2() -> None:
    refused = run_cli("flow", "start", "test_fan", '{"key": "k", "n": 0}')
    assert refused.returncode == 2 and "n: Input should be greater than or equal to 1" in refused.stderr, refused
    as_json = run_cli("flow", "start", "test_fan", '{"n": 2}', "--json")
    assert as_json.returncode == 2
    assert [e["loc"] for e in json.loads(as_json.stdout)["details"]] == [["key"]]
    assert run_cli("flow", "start", "test_fan", "not json").returncode == 2
    unknown = run_cli("flow", "start", "nope", "{}")
    assert unknown.returncode == 2 and "test_chain" in unknown.stderr
    assert run_cli("flow", "start", "test_chain").returncode == 2  # no input at all
    assert run_cli("flow", "start", "test_chain", "{}", "--example").returncode == 2  # two inputs
    no_example = run_cli("flow", "start", "test_chain", "--example")
    assert no_example.returncode == 2 and "no example input" in no_example.stderr
    missing = str(uuid.uuid4())
    for command in (["status", missing], ["status", missing, "--watch"], ["cancel", missing]):
        result = run_cli("flow", *command)
        assert result.returncode == 2 and missing in result.stderr, result
    assert run_cli("flow", "list", "--flow", "nope").returncode == 2


def test_cancel_a_running_flow_then_exit_1(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    try:
        flow_id = json.loads(
            run_cli("flow", "start", "test_fan", json.dumps({"key": key, "n": 1, "ends": "release"}), "--json").stdout
        )["id"]
        wait_for(lambda: any(r["event"] == "start" for r in run_records(key)), 20, 0.05, what="the item to start")
        running = run_cli("flow", "status", flow_id).stdout.splitlines()
        assert running[1].startswith("state:    running")
        assert any(line.split()[:3] == ["join", "waiting", "for"] for line in running), running
        cancelled = run_cli("flow", "cancel", flow_id)
        assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{flow_id} cancelled"
        again = run_cli("flow", "cancel", flow_id, "--json")
        assert again.returncode == 1 and "nothing to cancel" in json.loads(again.stdout)["error"]
        ended = run_cli("flow", "status", flow_id, "--watch")
        assert ended.returncode == 1 and ended.stdout.splitlines()[1].startswith("state:    cancelled")
    finally:
        redis_server.client().set(f"test:release:{key}", "1")


@pytest.mark.usefixtures("clean_dlq")
def test_a_failed_flow_names_its_step_and_the_replay_that_continues_it(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    redis_server.client().set(f"test:flag:{key}:second", "1")
    failed = run_cli("flow", "start", "test_chain", json.dumps({"key": key, "second": "flag"}), "--wait")
    assert failed.returncode == 1, failed
    lines = failed.stdout.splitlines()
    assert lines[1].startswith("state:    failed at step second")
    assert lines[-1].startswith("to continue it from the failed step: pipeline dlq replay ")
    redis_server.client().delete(f"test:flag:{key}:second")
    replay = lines[-1].split(": ", 1)[1].split()
    assert run_cli(*replay[1:]).returncode == 0
    flow_id = failed.stderr.split()[-1]
    assert run_cli("flow", "status", flow_id, "--watch").returncode == 0
