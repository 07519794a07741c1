"""Flows over HTTP: the declared flows, a start followed to success step by step, invalid input refused naming the
field, unknown names and ids, and a cancel (then 409). A uvicorn subprocess serving the API with the test flows
declared (`tests.support.api_app`), the session's Redis and in-process worker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.flows import INVOICE_EXAMPLE
from tests.support.api import TEST_APP, ApiServer
from tests.support.inproc import InProcessWorker
from tests.support.procs import RedisServer, wait_for
from tests.support.worker_app import run_records

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(session_worker: InProcessWorker, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("flows", work_dir / "logs", app=TEST_APP).start()
    yield server
    server.stop()


def until(client: httpx.Client, flow_id: str, state: str, timeout: float = 30) -> dict[str, Any]:
    """Poll `GET /flows/{id}` until the flow is in `state`; every status seen is checked on the way."""
    seen: list[dict[str, Any]] = []

    def reached() -> bool:
        response = client.get(f"/flows/{flow_id}")
        assert response.status_code == 200, response.text
        seen.append(response.json())
        return bool(seen[-1]["state"] == state)

    try:
        wait_for(reached, timeout, 0.1, what=f"flow {flow_id} {state}")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last status {seen[-1:]}") from None
    return seen[-1]


def test_the_declared_flows_with_their_inputs_examples_and_steps(api: ApiServer) -> None:
    with api.client() as client:
        kinds = {k["name"]: k for k in client.get("/flows/kinds").json()}
    assert {"invoice", "media", "test_chain", "test_fan"} <= set(kinds)
    invoice = kinds["invoice"]
    assert invoice["example"] == INVOICE_EXAMPLE
    assert invoice["description"].startswith("Render an invoice PDF")
    assert invoice["input_schema"]["required"] == ["invoice", "to"]
    assert invoice["steps"] == [
        {"name": "render", "task": "pdf.render", "after": [], "fan_out": False},
        {"name": "email", "task": "email.send", "after": ["render"], "fan_out": False},
    ]
    assert [s["fan_out"] for s in kinds["media"]["steps"]] == [True, False]
    assert (kinds["test_chain"]["example"], kinds["test_chain"]["description"]) == (None, "")  # declared without


def test_a_chain_started_over_http_is_seen_step_by_step_until_it_succeeds(api: ApiServer) -> None:
    key = uuid.uuid4().hex
    with api.client() as client:
        response = client.post("/flows/test_chain", json={"key": key})
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert accepted == {"id": accepted["id"], "flow": "test_chain", "status_url": f"/flows/{accepted['id']}"}
        assert response.headers["location"] == accepted["status_url"]

        done = until(client, accepted["id"], "succeeded")
        assert done["final"] is True and done["progress"] == 100.0 and done["failed_step"] is None
        assert done["input"] == {"key": key, "second": "none"}
        assert [(s["name"], s["state"], s["jobs"], s["counts"]) for s in done["steps"]] == [
            ("first", "succeeded", 1, {"succeeded": 1}),
            ("second", "succeeded", 1, {"succeeded": 1}),
        ]
        for step in done["steps"]:  # each step's job is an ordinary job
            job = client.get(f"/jobs/{step['items'][0]['id']}").json()
            assert (job["state"], job["task"]) == ("succeeded", step["task"])

        listed = client.get("/flows", params={"flow": "test_chain", "limit": 200}).json()
        (row,) = [f for f in listed if f["id"] == accepted["id"]]
        assert (row["state"], row["final"], row["progress"]) == ("succeeded", True, 100.0)
        assert "input" not in row and "steps" not in row
        assert all(f["flow"] == "test_chain" for f in listed)
        assert len(client.get("/flows", params={"limit": 1}).json()) == 1


def test_a_fan_out_and_its_join_over_http(api: ApiServer) -> None:
    key = uuid.uuid4().hex
    with api.client() as client:
        keyed = {"Idempotency-Key": f"fan-{key}"}
        accepted = client.post("/flows/test_fan", json={"key": key, "n": 3}, headers=keyed).json()
        again = client.post("/flows/test_fan", json={"key": key, "n": 3}, headers=keyed)
        assert (again.status_code, again.json(), again.headers["location"]) == (202, accepted, accepted["status_url"])
        other = client.post("/flows/test_fan", json={"key": key, "n": 3}, headers={"Idempotency-Key": "bad key"})
        assert other.status_code == 422 and other.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
        done = until(client, accepted["id"], "succeeded")
    split, join = done["steps"]
    assert (split["fan_out"], split["jobs"], split["counts"]) == (True, 3, {"succeeded": 3})
    assert [item["node"] for item in split["items"]] == ["split[0]", "split[1]", "split[2]"]
    assert (join["after"], join["state"], join["jobs"]) == (["split"], "succeeded", 1)
    assert sum(r["event"] == "start" for r in run_records(key)) == 3  # one flow ran: its three items


def test_invalid_input_is_a_422_naming_the_field_and_unknown_names_and_ids_are_404(api: ApiServer) -> None:
    with api.client() as client:
        before = client.get("/flows", params={"limit": 500}).json()
        for body, loc in [({"key": "k", "n": 0}, ["body", "n"]), ({"n": 2}, ["body", "key"])]:
            refused = client.post("/flows/test_fan", json=body)
            assert refused.status_code == 422, refused.text
            assert [e["loc"] for e in refused.json()["detail"]] == [loc]
        assert client.post("/flows/test_fan", content=b"[1, 2]").status_code == 422
        # Strictly, as a batch of jobs: JSON types must match the schema (a date is not a number).
        dated = client.post(
            "/flows/invoice", json={**INVOICE_EXAMPLE, "invoice": {**INVOICE_EXAMPLE["invoice"], "issued_on": 0}}
        )
        assert [e["loc"] for e in dated.json()["detail"]] == [["body", "invoice", "issued_on"]], dated.text
        assert client.post("/flows/test_fan", content=b"{", headers={"Content-Type": "text/plain"}).status_code == 415
        # A payload the flow's first step refuses, though the input model took it: named, nothing stored.
        media = client.post("/flows/media", json={"source_uri": "ftp://x/y.mp4", "notify_url": "https://example.com"})
        assert media.status_code == 422, media.text
        assert media.json()["detail"][0]["loc"] == ["source_uri"]
        assert client.get("/flows", params={"limit": 500}).json() == before  # nothing was started

        unknown = client.post("/flows/nope", json={})
        assert unknown.status_code == 404 and "test_chain" in unknown.json()["detail"]
        assert client.get(f"/flows/{uuid.uuid4()}").status_code == 404
        assert client.post(f"/flows/{uuid.uuid4()}/cancel").status_code == 404
        assert client.get("/flows", params={"flow": "nope"}).status_code == 422
        # Flow names and ids share /flows/<x>: a name with a flow id's method (and `kinds` with POST) is a 405.
        wrong = client.get("/flows/test_chain")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        wrong = client.post("/flows/kinds", json={})
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET")
        refused = client.post(
            "/flows/media", json={"source_uri": "sample.mp4", "presets": ["720p", "720p"], "notify_url": "not a url"}
        )
        assert [(e["loc"], e["type"]) for e in refused.json()["detail"]] == [
            (["body", "presets"], "value_error"),
            (["body", "notify_url"], "url_parsing"),
        ], refused.text
        assert client.get("/flows", params={"limit": 0}).status_code == 422
        assert client.get("/flows", params={"state": "running"}).status_code == 422  # unknown parameter
        assert client.get("/flows/kinds", headers={"Authorization": "Bearer wrong-token-0000000"}).status_code == 401


def test_cancel_a_running_flow_then_409(api: ApiServer, redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    try:
        with api.client() as client:
            flow_id = client.post("/flows/test_fan", json={"key": key, "n": 1, "ends": "release"}).json()["id"]
            wait_for(lambda: any(r["event"] == "start" for r in run_records(key)), 20, 0.05, what="the item to start")
            running = client.get(f"/flows/{flow_id}").json()
            assert (running["state"], running["final"]) == ("running", False)
            # (test.run does not store STARTED: only tasks with track_started do, as pdf.render and media.transcode)
            assert [s["state"] for s in running["steps"]] == ["queued", None]
            assert running["steps"][1]["waiting_for"] == ["split"]

            cancelled = client.post(f"/flows/{flow_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["state"] == "cancelled" and cancelled.json()["final"] is True
            assert cancelled.json()["steps"][0]["state"] == "cancelled"
            again = client.post(f"/flows/{flow_id}/cancel")
            assert again.status_code == 409 and "nothing to cancel" in again.json()["detail"]
            assert client.get(f"/flows/{flow_id}").json()["state"] == "cancelled"
    finally:
        redis_server.client().set(f"test:release:{key}", "1")


@pytest.mark.usefixtures("clean_dlq")
def test_a_failed_flow_names_its_step_and_can_be_cancelled(api: ApiServer, redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    redis_server.client().set(f"test:flag:{key}:second", "1")
    with api.client() as client:
        flow_id = client.post("/flows/test_chain", json={"key": key, "second": "flag"}).json()["id"]
        failed = until(client, flow_id, "failed")
        assert (failed["final"], failed["failed_step"]) == (True, "second")
        assert [s["state"] for s in failed["steps"]] == ["succeeded", "dead_lettered"]
        cancelled = client.post(f"/flows/{flow_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text


def test_a_full_or_unreachable_broker_is_a_503_and_no_flow_is_started(work_dir: Path) -> None:
    redis = RedisServer(work_dir / "flows-outage-redis").start()
    server = ApiServer("flows-outage", work_dir / "logs", {"REDIS_URL": redis.url}).start()
    try:
        with server.client() as client:
            client.get("/readyz").raise_for_status()
            redis.client().config_set("maxmemory", "1")  # below what it uses: every write is refused
            keyed = {"Idempotency-Key": "invoice-full"}
            full = client.post("/flows/invoice", json=INVOICE_EXAMPLE, headers=keyed)
            assert full.status_code == 503 and int(full.headers["retry-after"]) > 0, full.text
            assert "maxmemory" in full.json()["detail"]
            redis.client().config_set("maxmemory", "0")
            assert client.get("/flows").json() == []  # nothing of it was stored, and its key is free:
            retried = client.post("/flows/invoice", json=INVOICE_EXAMPLE, headers=keyed)
            assert retried.status_code == 202 and [f["id"] for f in client.get("/flows").json()] == [
                retried.json()["id"]
            ]

            redis.stop()
            down = client.post("/flows/invoice", json=INVOICE_EXAMPLE)
            assert down.status_code == 503 and int(down.headers["retry-after"]) > 0, down.text
            assert "nothing was stored" in down.json()["detail"]
            flow_id = str(uuid.uuid4())
            for response in (
                client.get("/flows"),
                client.get(f"/flows/{flow_id}"),
                client.post(f"/flows/{flow_id}/cancel"),
            ):
                assert response.status_code == 503, response.text
    finally:
        server.stop()
        redis.stop()
