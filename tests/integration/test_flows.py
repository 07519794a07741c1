"""Flows on a real worker: typed hand-offs, a fan-out and its join, a diamond, failure at a step and the replay that
continues from it, cancel, and bad input refused at start."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from pipeline.control.flows import FlowFinished, FlowState, FlowStatus, cancel_flow, flow_status, list_flows
from pipeline.dlq import admin as dlq
from pipeline.errors import PayloadInvalid
from pipeline.flows import FlowNotFound, start
from pipeline.status import JobState
from tests.support.flow_client import FlowClient
from tests.support.procs import RedisServer, wait_for
from tests.support.worker_app import attempts, run_records

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("session_worker")]


def _until(flow_id: str, state: FlowState, limit_s: float = 30) -> FlowStatus:
    seen: list[FlowStatus] = []

    def reached() -> bool:
        seen.append(flow_status(flow_id))
        return seen[-1].state is state

    wait_for(reached, limit_s, 0.05, what=f"flow {flow_id} {state}")
    return seen[-1]


def _step(status: FlowStatus, name: str) -> Any:
    return next(s for s in status.steps if s.name == name)


def test_a_chain_hands_the_first_steps_result_to_the_second() -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_chain", {"key": key})
    done = _until(flow_id, FlowState.SUCCEEDED)
    assert [s.state for s in done.steps] == [JobState.SUCCEEDED, JobState.SUCCEEDED]
    assert done.progress == 100.0 and done.finished_at is not None and done.input == {"key": key, "second": "none"}
    assert len(attempts(f"{key}:second")) == 1
    assert [r["event"] for r in run_records(key)] == ["start", "finish"]
    assert flow_id in [f.id for f in list_flows(name="test_chain")]


def test_a_start_with_an_idempotency_key_used_before_returns_the_first_flow(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    first = start("test_chain", {"key": key}, idempotency_key=key)
    assert start("test_chain", {"key": key, "second": "transient"}, idempotency_key=key) == first
    other = start("test_diamond", {"key": key}, idempotency_key=key)  # a key is per flow name
    assert other != first
    held = f"pipeline:flow-start:test_chain:{key}"
    assert redis_server.client().get(held) == first.encode() and redis_server.client().ttl(held) > 0
    _until(first, FlowState.SUCCEEDED)
    _until(other, FlowState.SUCCEEDED)
    assert len(attempts(f"{key}:second")) == 1  # one flow of test_chain ran


def test_a_step_that_retries_keeps_its_place_in_the_flow() -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_chain", {"key": key, "second": "transient"})
    _until(flow_id, FlowState.SUCCEEDED, limit_s=60)
    assert [a["attempt"] for a in attempts(f"{key}:second")] == [1, 2]


def test_a_fan_out_runs_every_item_and_its_join_once_with_all_results() -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_fan", {"key": key, "n": 25})
    done = _until(flow_id, FlowState.SUCCEEDED)
    split = _step(done, "split")
    assert (split.jobs, split.counts, split.fan_out) == (25, {"succeeded": 25}, True)
    assert len({job.id for job in split.items}) == 25
    assert sum(r["event"] == "finish" for r in run_records(key)) == 25
    assert len(attempts(f"{key}:join:25")) == 1  # the join ran once, with the 25 results


def _commands(server: RedisServer) -> int:
    """Commands the server has run (INFO commandstats), not counting INFO itself."""
    stats: dict[str, Any] = server.client().info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def test_the_status_of_a_thousand_way_fan_out_takes_a_bounded_number_of_commands(own_redis: RedisServer) -> None:
    """On a Redis of its own that no worker reads, the commands one status costs, whatever the fan-out's size: a round
    trip carries at least one, so they bound the round trips too (5 here: the flow's hash, then one pipeline of its
    sets, then every job's result, record and due time, each in one command)."""
    with FlowClient(own_redis.url) as flows:
        flow_id = flows.start("test_fan", {"key": uuid.uuid4().hex, "n": 1000})
        flows.status(flow_id)  # connections made: what follows is the steady state
        before = _commands(own_redis)
        queued = flows.status(flow_id)
        spent = _commands(own_redis) - before
        split = queued["steps"][0]
        assert (split["jobs"], split["counts"], len(split["items"])) == (1000, {"queued": 1000}, 50)
        assert spent <= 12, spent  # 9, and a connection's handshake at times (up to 3,000 when read job by job)

        flows.race(flow_id, copies=1, threads=4)  # every item recorded as if it ran: the join is queued
        before = _commands(own_redis)
        joining = flows.status(flow_id)
        spent = _commands(own_redis) - before
    assert [(s["counts"], s["state"]) for s in joining["steps"]] == [
        ({"succeeded": 1000}, "succeeded"),
        ({"queued": 1}, "queued"),
    ]
    assert spent <= 12, spent


def test_a_diamond_joins_two_parallel_steps_once() -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_diamond", {"key": key})
    done = _until(flow_id, FlowState.SUCCEEDED)
    assert [s.name for s in done.steps] == ["top", "left", "right", "bottom"]
    assert len(attempts(f"{key}:bottom:{key}:left+{key}:right")) == 1


@pytest.mark.usefixtures("clean_dlq")
def test_a_step_that_dead_letters_fails_the_flow_and_its_replay_continues_from_it(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    redis_server.client().set(f"test:flag:{key}:second", "1")
    flow_id = start("test_chain", {"key": key, "second": "flag"})
    failed = _until(flow_id, FlowState.FAILED)
    assert failed.failed_step == "second"
    assert _step(failed, "second").state is JobState.DEAD_LETTERED
    entry = dlq.find(_step(failed, "second").items[0].id)
    assert entry is not None and entry.row().flow == f"test_chain {flow_id} second"

    redis_server.client().delete(f"test:flag:{key}:second")
    new_id = dlq.replay(entry.id)
    assert flow_status(flow_id).state is not FlowState.FAILED  # replayed: running again (or already done)
    done = _until(flow_id, FlowState.SUCCEEDED)
    assert _step(done, "second").items[0].id == new_id
    assert len(attempts(f"{key}:second")) == 2  # the failed run, then the replay
    assert sum(r["event"] == "start" for r in run_records(key)) == 1  # the first step was not run again


def test_cancelling_a_flow_cancels_its_running_step_and_queues_nothing_after_it(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_fan", {"key": key, "n": 1, "ends": "release"})
    wait_for(lambda: any(r["event"] == "start" for r in run_records(key)), 20, 0.05, what="the item to start")
    status = cancel_flow(flow_id)
    assert status.state is FlowState.CANCELLED
    assert _step(status, "split").state is JobState.CANCELLED
    redis_server.client().set(f"test:release:{key}", "1")
    with pytest.raises(FlowFinished):
        cancel_flow(flow_id)
    status = flow_status(flow_id)
    assert _step(status, "join").state is None and status.state is FlowState.CANCELLED
    assert attempts(f"{key}:join:1") == []


def test_bad_input_and_unknown_flows_are_refused_at_start() -> None:
    with pytest.raises(PayloadInvalid) as caught:
        start("test_fan", {"key": "k", "n": 0})
    assert caught.value.errors[0]["loc"] == ["n"]
    with pytest.raises(PayloadInvalid, match="the limit is 10000"):
        start("test_fan", {"key": "k", "n": 10_001})
    with pytest.raises(FlowNotFound, match="no flow named 'nope'"):
        start("nope", {})
    with pytest.raises(FlowNotFound):
        flow_status(str(uuid.uuid4()))


def test_a_flow_records_each_step_as_the_job_it_runs(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    flow_id = start("test_chain", {"key": key})
    done = _until(flow_id, FlowState.SUCCEEDED)
    first = _step(done, "first").items[0]
    stored = json.loads(redis_server.client().hget(f"pipeline:flow:{{{flow_id}}}:results", "first"))
    assert stored["key"] == key and first.state is JobState.SUCCEEDED
    # the job's own result, stored by the call that recorded its node: Celery's meta, as any job's
    meta = json.loads(redis_server.client().get(f"celery-task-meta-{first.id}"))
    assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", stored, first.id)
    assert redis_server.client().ttl(f"celery-task-meta-{first.id}") > 0
