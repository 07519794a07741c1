"""The producer API over real HTTP: uvicorn subprocesses, a real Redis, real Celery workers.

Two servers: `api` shares the session Redis and worker (jobs run); `idle` has a Redis of its own that no
worker consumes, so jobs stay exactly where the API put them (queued, scheduled) and outages of that
Redis disturb nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.config import get_settings
from pipeline.dlq.envelope import DeadLetter
from tests.support.api import ApiServer, sse_events, wait_state
from tests.support.inproc import InProcessWorker
from tests.support.procs import ROOT, RedisServer, Worker, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(session_worker: InProcessWorker, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("main", work_dir / "logs").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idle(work_dir: Path) -> Iterator[ApiServer]:
    redis = RedisServer(work_dir / "idle-redis").start()
    server = ApiServer("idle", work_dir / "logs", {"REDIS_URL": redis.url}).start()
    yield server
    server.stop()
    redis.stop()


def depth(client: httpx.Client, queue: str = "default") -> int:
    stats = client.get("/queues").json()
    return int(next(q["depth"] for q in stats["queues"] if q["name"] == queue))


# --- jobs end to end ------------------------------------------------------------------------------


def test_probe_job_runs_and_streams_progress_until_it_succeeds(api: ApiServer) -> None:
    with api.client() as client:
        response = client.post("/jobs/probe", json={"message": "e2e", "sleep_s": 2, "progress_steps": 4})
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert accepted["status_url"] == f"/jobs/{accepted['id']}"
        assert response.headers["location"] == accepted["status_url"]

        events = list(sse_events(client, f"{accepted['status_url']}/events"))

    states = [data["state"] for _, data in events]
    percents = [data["progress"]["percent"] for _, data in events if data["state"] == "progress"]
    assert states[-1] == "succeeded", events
    assert set(states) <= {"queued", "started", "progress", "succeeded"}
    assert percents, f"no progress event among {states}"
    assert percents == sorted(percents)
    assert all(0 < p <= 100 for p in percents)
    final = events[-1][1]
    assert final["final"] is True
    assert [data["final"] for _, data in events[:-1]] == [False] * (len(events) - 1)
    assert final["result"]["message"] == "e2e"
    assert final["progress"]["percent"] == 100
    assert final["attempts"] == 1
    assert final["task"] == "pipeline.probe"
    assert final["accepted_at"]
    assert final["finished_at"]


def test_permanent_failure_is_dead_lettered_and_operable_over_http(api: ApiServer, clean_dlq: None) -> None:
    with api.client() as client:
        job = client.post("/jobs/probe", json={"message": "doomed", "fail": "permanent"}).json()
        status = wait_state(client, job["id"], {"dead_lettered"})
        assert status["final"] is True and status["dlq_id"]
        assert status["error"]["type"] == "PermanentError"
        assert "doomed" in status["error"]["message"]

        rows = client.get("/dlq", params={"task": "pipeline.*", "exception": "PermanentError"}).json()
        assert [r["task_id"] for r in rows] == [job["id"]]
        assert rows == [DeadLetter.model_validate(client.get(f"/dlq/{job['id']}").json()).row().model_dump(mode="json")]
        assert client.get("/dlq", params={"task": "email.*"}).json() == []
        assert client.get("/dlq", params={"since": "1h"}).json()[0]["id"] == status["dlq_id"]
        assert client.get("/dlq", params={"since": "not a time"}).status_code == 422

        entry = client.get(f"/dlq/{status['dlq_id']}").json()
        assert entry["args"] == [
            {"message": "doomed", "fail": "permanent", "fail_times": 0, "sleep_s": 0.0, "progress_steps": 0}
        ]
        assert "PermanentError" in entry["traceback"]

        replayed = client.post(f"/dlq/{status['dlq_id']}/replay")
        assert replayed.status_code == 202, replayed.text
        new_id = replayed.json()["new_task_id"]
        assert new_id != job["id"]
        assert client.get(f"/dlq/{status['dlq_id']}").status_code == 404  # removed once republished
        again = wait_state(client, new_id, {"dead_lettered"})  # it fails again, as its payload says

        assert client.delete(f"/dlq/{again['dlq_id']}").json() == {"deleted": again["dlq_id"]}
        assert client.delete(f"/dlq/{again['dlq_id']}").status_code == 404
        assert client.post(f"/dlq/{uuid.uuid4().hex}/replay").status_code == 404
        assert client.get("/dlq").json() == []


# --- states without a worker ---------------------------------------------------------------------


def test_unknown_queued_and_scheduled_are_told_apart(idle: ApiServer) -> None:
    with idle.client() as client:
        never = str(uuid.uuid4())
        assert client.get(f"/jobs/{never}").json()["state"] == "unknown"
        assert client.get(f"/jobs/{never}").json()["final"] is True
        assert [d["state"] for _, d in sse_events(client, f"/jobs/{never}/events", timeout=10)] == ["unknown"]

        queued = client.post("/jobs/probe", json={}).json()
        status = client.get(f"/jobs/{queued['id']}").json()
        assert status["state"] == "queued" and status["final"] is False
        assert status["task"] == "pipeline.probe"
        assert status["attempts"] == 0

        later = client.post("/jobs/probe", params={"delay_seconds": 120}, json={}).json()
        status = client.get(f"/jobs/{later['id']}").json()
        assert status["state"] == "scheduled"
        eta = datetime.fromisoformat(status["eta"])
        assert timedelta(seconds=100) < eta - datetime.now(UTC) <= timedelta(seconds=121)

        at = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
        assert (
            client.get(client.post("/jobs/probe", params={"eta": at}, json={}).json()["status_url"]).json()["state"]
            == "scheduled"
        )

        both = client.post("/jobs/probe", params={"eta": at, "delay_seconds": 5}, json={})
        assert both.status_code == 422


def test_long_delays_are_parked_and_a_year_is_the_limit(idle: ApiServer) -> None:
    beyond = get_settings().lease_seconds * 3  # parked in Redis: no worker holds it meanwhile
    with idle.client() as client:
        before = depth(client)
        accepted = client.post("/jobs/probe", params={"delay_seconds": beyond}, json={})
        assert accepted.status_code == 202
        status = client.get(accepted.json()["status_url"]).json()
        assert status["state"] == "scheduled"
        ahead = datetime.fromisoformat(status["eta"]) - datetime.now(UTC)
        assert timedelta(seconds=beyond - 60) < ahead <= timedelta(seconds=beyond + 1)

        at = (datetime.now(UTC) + timedelta(days=200)).isoformat()
        later = client.post("/jobs/probe", params={"eta": at}, json={})
        assert later.status_code == 202
        assert client.get(later.json()["status_url"]).json()["state"] == "scheduled"
        assert depth(client) == before  # both parked, not waiting on the queue

        too_far = client.post("/jobs/probe", params={"delay_seconds": 366 * 86400}, json={})
        assert too_far.status_code == 422
        assert too_far.json()["detail"][0]["loc"] == ["query", "delay_seconds"]
        far_eta = (datetime.now(UTC) + timedelta(days=366)).isoformat()
        too_late = client.post("/jobs/probe", params={"eta": far_eta}, json={})
        assert too_late.status_code == 422
        assert "365 days" in too_late.json()["detail"][0]["msg"]
        negative = client.post("/jobs/probe", params={"delay_seconds": -1}, json={})
        assert negative.status_code == 422
        assert depth(client) == before

        operation = client.get("/openapi.json").json()["paths"]["/jobs/probe"]["post"]
        params = {p["name"]: p for p in operation["parameters"]}
        assert params["delay_seconds"]["schema"]["anyOf"][0]["maximum"] == 365 * 86400
        assert "365 days" in params["delay_seconds"]["description"]
        assert "365 days" in params["eta"]["description"]


def test_idempotency_key_returns_the_same_job(idle: ApiServer) -> None:
    key = f"order-{uuid.uuid4().hex}"
    with idle.client() as client:
        before = depth(client)
        first = client.post("/jobs/probe", json={"message": "once"}, headers={"Idempotency-Key": key})
        second = client.post("/jobs/probe", json={"message": "once"}, headers={"Idempotency-Key": key})
        assert first.status_code == second.status_code == 202
        assert first.json()["id"] == second.json()["id"]
        assert depth(client) == before + 1  # one message, not two

        other = client.post("/jobs/probe", json={"message": "once"}, headers={"Idempotency-Key": key + "-b"})
        assert other.json()["id"] != first.json()["id"]
        bad = client.post("/jobs/probe", json={}, headers={"Idempotency-Key": "has space"})
        assert bad.status_code == 422


def test_a_batch_is_published_whole_or_not_at_all(idle: ApiServer) -> None:
    with idle.client() as client:
        before = depth(client)
        bad = client.post("/jobs/probe/batch", json=[{"message": "a"}, {"message": "b", "sleep_s": -1}])
        assert bad.status_code == 422
        assert [e["loc"] for e in bad.json()["detail"]] == [["body", 1, "sleep_s"]]
        assert client.post("/jobs/probe/batch", json=[]).status_code == 422
        assert depth(client) == before  # nothing of a refused batch was published

        accepted = client.post("/jobs/probe/batch", json=[{"message": f"m{i}"} for i in range(30)])
        assert accepted.status_code == 202
        ids = accepted.json()["ids"]
        assert len(set(ids)) == 30 and accepted.json()["status_urls"][0] == f"/jobs/{ids[0]}"
        assert depth(client) == before + 30
        assert {client.get(f"/jobs/{i}").json()["state"] for i in ids} == {"queued"}


# --- refusals ----------------------------------------------------------------------------------------


def test_every_data_route_needs_the_bearer_token(api: ApiServer) -> None:
    schema = httpx.get(f"{api.url}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["token"]["scheme"] == "bearer"
    protected = [
        (method, path.replace("{job_id}", "x").replace("{entry_id}", "x"))
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
        if op.get("security")
    ]
    assert len(protected) >= 9  # probe enqueue, job, events, kinds, queues, dlq list/show/replay/delete
    for token in (None, "wrong-token-0123456789", api.token + "x"):
        with api.client(token=token) as client:
            for method, path in protected:
                response = client.request(method.upper(), path, json={})
                assert response.status_code == 401, (method, path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
    basic = httpx.get(f"{api.url}/queues", headers={"Authorization": f"Basic {api.token}"})
    assert basic.status_code == 401
    for open_path in ("/healthz", "/readyz", "/", "/openapi.json", "/docs", "/static/app.js"):
        assert httpx.get(f"{api.url}{open_path}").status_code == 200, open_path


def test_bodies_over_the_limit_are_refused_before_parsing(api: ApiServer) -> None:
    big = b'{"message": "' + b"a" * (600 * 1024) + b'"}'
    with api.client() as client:
        declared = client.post("/jobs/probe", content=big, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413
        assert "limit" in declared.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked, counted as it streams
            for i in range(0, len(big), 64 * 1024):
                yield big[i : i + 64 * 1024]

        streamed = client.post("/jobs/probe", content=chunks(), headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413


def test_invalid_payloads_get_field_errors_and_publish_nothing(idle: ApiServer) -> None:
    with idle.client() as client:
        before = depth(client)
        wrong = client.post("/jobs/probe", json={"message": 5, "sleep_s": -1, "surprise": True})
        assert wrong.status_code == 422
        errors = {tuple(e["loc"]): e for e in wrong.json()["detail"]}
        assert set(errors) == {("body", "message"), ("body", "sleep_s"), ("body", "surprise")}
        assert errors[("body", "surprise")]["type"] == "extra_forbidden"
        assert all("input" not in e for e in wrong.json()["detail"])  # the input is not echoed back

        assert client.post("/jobs/probe", json=[1, 2]).status_code == 422
        assert (
            client.post("/jobs/probe", content=b"{not json", headers={"Content-Type": "application/json"}).status_code
            == 422
        )
        assert (
            client.post(
                "/jobs/probe", content=b"message=x", headers={"Content-Type": "application/x-www-form-urlencoded"}
            ).status_code
            == 415
        )
        typo = client.post("/jobs/probe", params={"delay": 60}, json={})  # meant delay_seconds: not run at once
        assert typo.status_code == 422
        assert typo.json()["detail"][0]["loc"] == ["query", "delay"]
        wrong_method = client.put("/dlq/some-entry")
        assert wrong_method.status_code == 405
        assert wrong_method.headers["allow"] == "DELETE, GET"
        unknown = client.post("/jobs/no-such-kind", json={})
        assert unknown.status_code == 404
        assert "probe" in unknown.json()["detail"]
        assert depth(client) == before


def test_queues_report_depth_and_in_flight(idle: ApiServer) -> None:
    with idle.client() as client:
        before = depth(client)
        client.post("/jobs/probe", json={})
        stats = client.get("/queues").json()
    names = [q["name"] for q in stats["queues"]]
    assert {"default", "email", "pdf", "transcode", "webhooks", "dead_letter"} <= set(names)
    default = next(q for q in stats["queues"] if q["name"] == "default")
    assert default["depth"] == before + 1
    assert default["oldest_wait_s"] is not None
    assert stats["in_flight"] == 0


def test_a_paused_queue_keeps_accepting_jobs_until_resumed_over_the_api(idle: ApiServer) -> None:
    with idle.client() as client:
        try:
            paused = client.post("/queues/default/pause")
            assert paused.status_code == 200 and paused.json() == {"name": "default", "paused": True, "changed": True}
            assert client.post("/queues/default/pause").json()["changed"] is False
            before = depth(client)
            assert client.post("/jobs/probe", json={}).status_code == 202
            queues = {q["name"]: q for q in client.get("/queues").json()["queues"]}
            assert queues["default"]["paused"] is True and queues["default"]["depth"] == before + 1
            assert queues["email"]["paused"] is False
            unknown = client.post("/queues/nope/pause")
            assert unknown.status_code == 404 and "no queue 'nope' the app routes to" in unknown.json()["detail"]
            assert client.post("/queues/dead_letter/pause").status_code == 409
            with idle.client(token=None) as anonymous:
                assert anonymous.post("/queues/default/resume").status_code == 401
        finally:
            resumed = client.post("/queues/default/resume")
        assert resumed.json() == {"name": "default", "paused": False, "changed": True}
        assert next(q for q in client.get("/queues").json()["queues"] if q["name"] == "default")["paused"] is False


def test_the_server_refuses_to_start_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "API_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "uvicorn", "pipeline.api:app", "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert b"API_TOKEN is not set" in proc.stdout + proc.stderr


# --- broker outage ------------------------------------------------------------------------------------


@pytest.fixture
def outage_api(work_dir: Path) -> Iterator[tuple[RedisServer, ApiServer]]:
    redis = RedisServer(work_dir / f"outage-redis-{uuid.uuid4().hex[:6]}").start()
    server = ApiServer("outage", work_dir / "logs", {"REDIS_URL": redis.url}).start()
    yield redis, server
    server.stop()
    redis.stop()


def test_broker_down_is_503_with_retry_after_then_jobs_flow_again(
    outage_api: tuple[RedisServer, ApiServer], make_worker: Callable[..., Worker]
) -> None:
    redis, api = outage_api
    assert api.proc is not None
    api_pid = api.proc.pid
    with api.client() as client:
        before = client.post("/jobs/probe", json={"message": "before"}).json()
        streamed: list[tuple[str, dict[str, Any]]] = []

        def follow() -> None:
            with api.client() as stream_client:
                streamed.extend(sse_events(stream_client, f"/jobs/{before['id']}/events", timeout=60))

        follower = threading.Thread(target=follow)
        follower.start()
        wait_for(lambda: streamed, 10, what="the first event of the stream")
        redis.stop()

        down = client.post("/jobs/probe", json={"message": "during"})
        assert down.status_code == 503, down.text
        assert int(down.headers["retry-after"]) > 0
        assert "nothing was stored" in down.json()["detail"]
        keyed = client.post("/jobs/probe", json={}, headers={"Idempotency-Key": "outage-key"})
        assert keyed.status_code == 503
        assert client.get("/readyz").status_code == 503
        assert client.get(f"/jobs/{before['id']}").status_code == 503
        assert client.get("/queues").status_code == 503
        assert client.get("/healthz").status_code == 200  # alive, just not ready
        follower.join(30)  # an open event stream says so and closes
        assert not follower.is_alive()
        assert [event for event, _ in streamed] == ["status", "error"]
        assert streamed[0][1]["state"] == "queued"
        assert "unreachable" in streamed[1][1]["detail"]

        redis.start()  # same port and directory: the AOF brings the queued job back
        wait_for(lambda: client.get("/readyz").status_code == 200, 30, 0.2, what="readyz after restart")
        after = client.post("/jobs/probe", json={"message": "after"})
        assert after.status_code == 202, after.text
        keyed = client.post("/jobs/probe", json={}, headers={"Idempotency-Key": "outage-key"})
        assert keyed.status_code == 202  # the failed attempt did not keep the key
        assert api.proc.pid == api_pid and api.proc.poll() is None  # the same process served throughout

        make_worker("outage", env={"REDIS_URL": redis.url})
        results = {
            job_id: wait_state(client, job_id, {"succeeded", "dead_lettered"}, timeout=90)
            for job_id in (before["id"], after.json()["id"])
        }
    assert [r["result"]["message"] for r in results.values()] == ["before", "after"]


def test_kinds_offer_the_job_types_and_not_housekeeping(api: ApiServer) -> None:
    with api.client() as client:
        kinds = {k["kind"] for k in client.get("/kinds").json()}
        assert {"probe", "email", "pdf", "transcode", "webhook"} <= kinds
        assert not kinds & {"dlq-retention", "artifact-purge"}
        assert client.post("/jobs/dlq-retention", json={}).status_code == 404


def levels(client: httpx.Client, queue: str = "default") -> dict[str, int]:
    stats = client.get("/queues").json()
    return dict(next(q["levels"] for q in stats["queues"] if q["name"] == queue))


def test_priority_picks_the_level_and_a_bad_one_is_refused(idle: ApiServer) -> None:
    """`?priority=` on one job and on a batch: the job waits at its priority's level (none given: the default's,
    3); out of range or not an integer is a 422 naming the parameter, and nothing is published."""
    with idle.client() as client:
        before = levels(client)
        assert client.post("/jobs/probe", params={"priority": 0}, json={}).status_code == 202
        assert client.post("/jobs/probe", json={}).status_code == 202
        batch = client.post("/jobs/probe/batch", params={"priority": 7}, json=[{}, {}])
        assert batch.status_code == 202
        after = levels(client)
        assert {k: after[k] - before[k] for k in after} == {"0": 1, "3": 1, "6": 2, "9": 0}

        for bad in ("10", "-1", "1.5", "urgent", "true"):
            one = client.post("/jobs/probe", params={"priority": bad}, json={})
            assert one.status_code == 422, bad
            assert one.json()["detail"][0]["loc"] == ["query", "priority"]
            many = client.post("/jobs/probe/batch", params={"priority": bad}, json=[{}])
            assert many.status_code == 422, bad
            assert many.json()["detail"][0]["loc"] == ["query", "priority"]
        assert levels(client) == after
