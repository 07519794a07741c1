"""`GET /jobs`, the job browser, over real HTTP: every queue's jobs by state, counts, paging, no payloads.

`idle` has a Redis of its own that no worker consumes, so waiting and scheduled jobs stay where the API put
them; `api` shares the session Redis and its worker, so jobs run, succeed, retry and get dead-lettered.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import ApiServer, wait_state
from tests.support.inproc import InProcessWorker
from tests.support.procs import RedisServer, running, wait_for

pytestmark = pytest.mark.integration

MARKER = "payload-text-that-must-not-be-listed"
STATES = ("waiting", "scheduled", "running", "retrying", "succeeded", "failed", "dead_lettered", "cancelled")


@pytest.fixture(scope="module")
def idle_redis(work_dir: Path) -> Iterator[RedisServer]:
    yield from running(RedisServer(work_dir / "browser-redis"))


@pytest.fixture(scope="module")
def idle(idle_redis: RedisServer, work_dir: Path) -> Iterator[ApiServer]:
    yield from running(ApiServer("browser-idle", work_dir / "logs", {"REDIS_URL": idle_redis.url}))


@pytest.fixture(scope="module")
def api(session_worker: InProcessWorker, work_dir: Path) -> Iterator[ApiServer]:
    yield from running(ApiServer("browser", work_dir / "logs"))


def listing(client: httpx.Client, queue: str, state: str, **params: Any) -> dict[str, Any]:
    response = client.get("/jobs", params={"queue": queue, "state": state, **params})
    assert response.status_code == 200, response.text
    assert MARKER not in response.text
    body: dict[str, Any] = response.json()
    return body


def every_page(client: httpx.Client, queue: str, state: str, limit: int) -> list[list[dict[str, Any]]]:
    pages, cursor = [], None
    while True:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        page = listing(client, queue, state, **params)
        pages.append(page["jobs"])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


def ids(client: httpx.Client, queue: str, state: str) -> list[str]:
    return [row["id"] for row in listing(client, queue, state, limit=500)["jobs"]]


def test_waiting_jobs_of_every_priority_page_newest_first_and_never_skip(
    idle: ApiServer, idle_redis: RedisServer
) -> None:
    with idle.client() as client:
        accepted = [client.post("/jobs/probe", json={"message": MARKER}).json()["id"] for _ in range(5)]
        redis = idle_redis.client()
        # Sent with the default priority (3): the oldest job moved to the next level, as if sent with priority 6.
        redis.rpoplpush("default\x06\x163", "default\x06\x166")

        first = listing(client, "default", "waiting", limit=2)
        assert first["total"] == 5
        assert first["counts"]["default"]["waiting"] == 5
        assert set(first["counts"]) == {"default", "email", "pdf", "transcode", "webhooks"}
        assert set(first["counts"]["email"].values()) == {0}
        pages = every_page(client, "default", "waiting", 2)
        assert [len(p) for p in pages] == [2, 2, 1]
        rows = [row for page in pages for row in page]
        # Priority step 3 first (newest first within it), then the lower-priority sub-queue.
        assert [r["id"] for r in rows] == [*reversed(accepted[1:]), accepted[0]]
        assert {r["priority"] for r in rows} == {3}
        assert first["waiting_levels"]["default"] == {"0": 0, "3": 4, "6": 1, "9": 0}
        assert {r["task"] for r in rows} == {"pipeline.probe"}
        assert {r["state"] for r in rows} == {"waiting"} and {r["queue"] for r in rows} == {"default"}
        assert all(r["enqueued_at"] and r["attempts"] == 0 for r in rows)

        # A worker taking the oldest jobs between two pages makes the next page skip nothing.
        page1 = listing(client, "default", "waiting", limit=2)
        redis.rpop("default\x06\x163")
        page2 = listing(client, "default", "waiting", limit=2, cursor=page1["next_cursor"])
        assert [r["id"] for r in page2["jobs"]] == [accepted[2], accepted[0]]  # accepted[1] was taken

        # An urgent job is listed first, at its level.
        urgent = client.post("/jobs/probe", params={"priority": 1}, json={"message": MARKER}).json()["id"]
        page = listing(client, "default", "waiting", limit=1)
        assert [(r["id"], r["priority"]) for r in page["jobs"]] == [(urgent, 1)]
        assert page["waiting_levels"]["default"] == {"0": 1, "3": 3, "6": 1, "9": 0}


def test_scheduled_jobs_page_by_due_time(idle: ApiServer) -> None:
    with idle.client() as client:
        delays = (1200, 600, 900)
        later = [
            client.post("/jobs/probe", params={"delay_seconds": d}, json={"message": MARKER}).json()["id"]
            for d in delays
        ]
        pages = every_page(client, "default", "scheduled", 2)
        rows = [row for page in pages for row in page]
        assert [len(p) for p in pages] == [2, 1]
        assert [r["id"] for r in rows] == [later[1], later[2], later[0]]
        assert [r["due_at"] for r in rows] == sorted(r["due_at"] for r in rows)
        assert {r["task"] for r in rows} == {"pipeline.probe"}
        assert listing(client, "default", "scheduled")["counts"]["default"]["scheduled"] == 3
        assert listing(client, "email", "scheduled")["jobs"] == []


def test_bad_queries_are_refused(idle: ApiServer) -> None:
    with idle.client() as client:
        assert client.get("/jobs", params={"queue": "nope", "state": "waiting"}).status_code == 422
        assert client.get("/jobs", params={"queue": "default", "state": "bogus"}).status_code == 422
        assert client.get("/jobs", params={"queue": "default"}).status_code == 422
        assert client.get("/jobs", params={"queue": "default", "state": "waiting", "limit": 0}).status_code == 422
        assert client.get("/jobs", params={"queue": "default", "state": "waiting", "page": 2}).status_code == 422
        bad = client.get("/jobs", params={"queue": "default", "state": "waiting", "cursor": "not-a-cursor"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "cursor"]
        client.post("/jobs/probe", json={})
        client.post("/jobs/probe", json={})
        cursor = listing(client, "default", "waiting", limit=1)["next_cursor"]
        assert cursor
        other = client.get("/jobs", params={"queue": "default", "state": "scheduled", "cursor": cursor})
        assert other.status_code == 422
    with idle.client(token=None) as anonymous:
        assert anonymous.get("/jobs", params={"queue": "default", "state": "waiting"}).status_code == 401


def test_running_retrying_succeeded_and_dead_lettered_jobs(api: ApiServer, clean_dlq: None) -> None:
    with api.client() as client:
        running = client.post("/jobs/probe", json={"message": MARKER, "sleep_s": 3}).json()["id"]
        wait_for(lambda: running in ids(client, "default", "running"), 30, 0.1, what="a running job listed")
        row = next(r for r in listing(client, "default", "running")["jobs"] if r["id"] == running)
        assert row["task"] == "pipeline.probe" and row["state"] == "running" and row["attempts"] == 1

        done = [client.post("/jobs/probe", json={"message": MARKER}).json()["id"] for _ in range(3)]
        for job_id in done:
            wait_state(client, job_id, {"succeeded"})
        succeeded = [r for page in every_page(client, "default", "succeeded", 2) for r in page]
        listed = [r["id"] for r in succeeded]
        assert listed.index(done[2]) < listed.index(done[1]) < listed.index(done[0])  # newest first
        assert len(listed) == len(set(listed))
        row = next(r for r in succeeded if r["id"] == done[0])
        assert row["finished_at"] and row["enqueued_at"] and row["attempts"] == 1 and row["task"] == "pipeline.probe"

        # Always failing transiently: retried with backoff (retrying), then dead-lettered for good.
        flaky = client.post("/jobs/probe", json={"message": MARKER, "fail": "transient"}).json()["id"]
        wait_for(lambda: flaky in ids(client, "default", "retrying"), 30, 0.05, what="a retrying job listed")
        doomed = client.post("/jobs/probe", json={"message": MARKER, "fail": "permanent"}).json()["id"]
        status = wait_state(client, doomed, {"dead_lettered"})
        wait_state(client, flaky, {"dead_lettered"})

        page = listing(client, "default", "dead_lettered")
        assert [r["id"] for r in page["jobs"]] == [flaky, doomed]  # newest first
        flaky_row, row = page["jobs"]
        assert row["dlq_id"] == status["dlq_id"] and row["attempts"] == 1
        assert row["enqueued_at"] == status["accepted_at"] and row["finished_at"]
        assert row["exception"] == "pipeline.errors.PermanentError"  # the type only: its message quotes the payload
        assert flaky_row["attempts"] == 5
        assert page["counts"]["default"]["dead_lettered"] == 2
        assert doomed not in ids(client, "default", "failed")  # a dead letter is listed once
        assert flaky not in ids(client, "default", "retrying")
        assert client.get(f"/dlq/{row['dlq_id']}").status_code == 200  # the detail, payload included
        assert set(page["counts"]["default"]) == set(STATES)


def test_a_waiting_or_scheduled_job_is_cancelled_over_http_once(idle: ApiServer, idle_redis: RedisServer) -> None:
    """`POST /jobs/{id}/cancel`: 200 with the status (`cancelled`, final), listed as cancelled; a second cancel is a
    409, an unknown id a 404. (Last in this module: the cancelled waiting job stays in its list, no worker here.)"""
    with idle.client() as client:
        waiting = client.post("/jobs/probe", json={"message": MARKER}).json()["id"]
        later = client.post("/jobs/probe", params={"delay_seconds": 600}, json={"message": MARKER}).json()["id"]
        for job in (waiting, later):
            answer = client.post(f"/jobs/{job}/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["state"] == "cancelled" and answer.json()["final"] is True
            again = client.post(f"/jobs/{job}/cancel")
            assert again.status_code == 409 and "has finished (cancelled)" in again.json()["detail"]
        assert client.get(f"/jobs/{waiting}").json()["state"] == "cancelled"
        assert idle_redis.client().zscore("pipeline:delayed", later) is None
        assert {waiting, later} <= set(ids(client, "default", "cancelled"))
        assert later not in ids(client, "default", "scheduled")
        unknown = client.post("/jobs/no-such-job/cancel")
        assert unknown.status_code == 404 and "no job no-such-job" in unknown.json()["detail"]
    with idle.client(token=None) as anonymous:
        assert anonymous.post(f"/jobs/{waiting}/cancel").status_code == 401
