"""The read side on a Redis Cluster URL, with queues on different masters: the API's `/queues`, `/jobs/{id}` and job
browser, `pipeline status --json`, `pipeline queues --json` and the exporter read the numbers seeded on each master.

The state is written straight to the cluster under the names `pipeline.queues.keys` gives (no worker or producer
runs on a cluster yet): waiting jobs on two priority levels, a paused flag, delivery records, a parked job, and job
records and results whose keys hash to different masters.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from redis.crc import key_slot

from pipeline.constants import DEAD_LETTER_QUEUE, HEADER_PUBLISHED_AT
from pipeline.dlq.envelope import DeadLetter
from pipeline.queues import jobkeys, keys
from tests.support.api import ApiServer, sse_events
from tests.support.cluster import Cluster
from tests.support.procs import ROOT, free_port, stop_process, wait_for
from tests.support.scrape import Samples, try_scrape, value

pytestmark = pytest.mark.integration

RESULT_KEY = "celery-task-meta-{id}"


def _message(task_id: str, task: str, published: float) -> str:
    """A kombu envelope as a producer LPUSHes it (the body is never read by the readers under test)."""
    headers = {"id": task_id, "task": task, "retries": 0, HEADER_PUBLISHED_AT: published}
    return json.dumps({"body": "W10=", "headers": headers, "properties": {"priority": 0, "body_encoding": "base64"}})


def _master(cluster: Cluster, key: str) -> int:
    return cluster.master_of(key_slot(key.encode())).port


def _spread_ids(cluster: Cluster, count: int) -> list[str]:
    """`count` task ids whose records (and results) do not all live on one master."""
    while True:
        ids = [uuid.uuid4().hex for _ in range(count)]
        records = {_master(cluster, jobkeys.record(i, True)) for i in ids}
        results = {_master(cluster, RESULT_KEY.format(id=i)) for i in ids}
        if len(records) > 1 and len(results) > 1:
            return ids


@dataclass
class Seeded:
    """What the test wrote: the ids of a succeeded and a queued job, every key to delete afterwards."""

    succeeded: list[str]
    queued: list[str]
    names: list[str]
    dead: list[str]


def _dead_letter(queue: str) -> DeadLetter:
    return DeadLetter(
        reason="failed",
        task_name="pdf.render",
        task_id=uuid.uuid4().hex,
        queue=queue,
        exception_type="tasks.errors.Broken",
        exception_message="broken",
    )


def _dead_envelope(entry: DeadLetter) -> str:
    """A dead-letter list element as the dead-letter queue holds it: a kombu envelope whose body is the entry."""
    body = base64.b64encode(entry.model_dump_json().encode()).decode()
    return json.dumps({"body": body, "headers": {}, "properties": {"body_encoding": "base64"}})


@pytest.fixture
def seeded(redis_cluster: Cluster) -> Iterator[Seeded]:
    client = redis_cluster.client()
    for queue in ("webhooks", "pdf", "email", "transcode"):  # the process's cluster: other files' jobs may be left
        client.delete(*keys.every(queue, cluster=True))  # one slot per queue
    client.delete(DEAD_LETTER_QUEUE)
    now = time.time()
    names: list[str] = []
    webhooks = keys.levels("webhooks", cluster=True)
    client.lpush(webhooks[0], _message("w-1", "webhooks.deliver", now - 5), _message("w-2", "webhooks.deliver", now))
    client.lpush(webhooks[2], _message("w-3", "webhooks.deliver", now))
    names += webhooks
    pdf = keys.levels("pdf", cluster=True)[0]
    client.lpush(pdf, _message("p-1", "pdf.render", now - 30))
    grouped = keys.group_jobs("pdf", pdf, "tenant-a", cluster=True)  # a fair group's job (`pipeline.fairness`)
    client.lpush(grouped, _message("p-2", "pdf.render", now))
    client.hset(keys.group_state("pdf", pdf, cluster=True), "tenant-a", "r")
    client.hset(keys.group_count("pdf", cluster=True), pdf, 1)
    names += [pdf, grouped, keys.group_state("pdf", pdf, cluster=True), keys.group_count("pdf", cluster=True)]
    client.set(keys.paused("email", cluster=True), "1")
    names.append(keys.paused("email", cluster=True))
    delivered = keys.unacked("email", cluster=True)
    for n in range(2):
        record = [json.loads(_message(f"e-{n}", "email.send", now)), "", "email"]
        client.hset(delivered, f"tag-{n}", json.dumps(record))
    names.append(delivered)
    index, messages, dests = keys.delayed("transcode", cluster=True)
    client.zadd(index, {"t-1": now + 3600})
    client.hset(messages, "t-1", _message("t-1", "media.transcode", now))
    client.hset(dests, "t-1", keys.level("transcode", 0, cluster=True))
    names += [index, messages, dests]
    succeeded, queued = _spread_ids(redis_cluster, 4), _spread_ids(redis_cluster, 4)
    accepted = "2026-01-01T00:00:00+00:00"
    for task_id in succeeded:
        meta: dict[str, Any] = {"status": "SUCCESS", "result": {"ok": True}, "name": "webhooks.deliver"}
        meta |= {"queue": "webhooks"}
        meta |= {"date_done": "2026-01-01T00:00:01+00:00", "retries": 0, "task_id": task_id}
        client.set(RESULT_KEY.format(id=task_id), json.dumps(meta))
        client.zadd(keys.recent("webhooks", cluster=True), {task_id: now})
        names.append(RESULT_KEY.format(id=task_id))
    for task_id in queued:
        client.set(jobkeys.record(task_id, True), json.dumps({"task": "pdf.render", "accepted_at": accepted}))
        names.append(jobkeys.record(task_id, True))
    names.append(keys.recent("webhooks", cluster=True))
    dead = [_dead_letter("pdf"), _dead_letter("pdf")]
    client.lpush(DEAD_LETTER_QUEUE, *(_dead_envelope(entry) for entry in dead))
    names.append(DEAD_LETTER_QUEUE)
    yield Seeded(succeeded, queued, names, [entry.id for entry in dead])
    for name in names:
        client.delete(name)


def _env(cluster: Cluster) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": cluster.url()}


def _cli(cluster: Cluster, *args: str) -> Any:
    argv = [sys.executable, "-m", "pipeline", *args]
    done = subprocess.run(argv, cwd=ROOT, env=_env(cluster), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_seeded_queues_live_on_different_masters(redis_cluster: Cluster) -> None:
    masters = {_master(redis_cluster, queue) for queue in ("webhooks", "pdf", "email", "transcode")}
    assert len(masters) > 1


def test_queues_and_status_read_every_master(redis_cluster: Cluster, seeded: Seeded) -> None:
    shown = {q["name"]: q for q in _cli(redis_cluster, "queues", "--json")["queues"]}
    assert shown["webhooks"]["depth"] == 3 and shown["webhooks"]["levels"] == {"0": 2, "3": 0, "6": 1, "9": 0}
    assert shown["pdf"]["depth"] == 2
    assert shown["email"]["paused"] is True and shown["webhooks"]["paused"] is False

    for task_id in seeded.succeeded:
        status = _cli(redis_cluster, "status", "--json", task_id)
        assert status["state"] == "succeeded" and status["result"] == {"ok": True}, status
    for task_id in seeded.queued:
        status = _cli(redis_cluster, "status", "--json", task_id)
        assert status["state"] == "queued" and status["task"] == "pdf.render", status
    listed = _cli(redis_cluster, "dlq", "list", "--json")
    assert sorted(row["id"] for row in listed) == sorted(seeded.dead)


@pytest.fixture
def api(redis_cluster: Cluster, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("cluster-reads", work_dir, env={"REDIS_URL": redis_cluster.url()}).start()
    yield server
    server.stop()


def test_the_api_and_the_job_browser_read_every_master(api: ApiServer, seeded: Seeded) -> None:
    with api.client() as client:
        assert client.get("/readyz").json() == {"status": "ready"}
        queues = client.get("/queues")
        assert queues.status_code == 200, queues.text
        by_name = {q["name"]: q for q in queues.json()["queues"]}
        assert by_name["webhooks"]["depth"] == 3 and by_name["pdf"]["depth"] == 2
        assert by_name["email"]["paused"] is True and by_name["email"]["in_flight"] == 2
        assert queues.json()["in_flight"] == 2
        assert by_name["pdf"]["oldest_wait_s"] >= 30

        for task_id in seeded.succeeded:
            assert client.get(f"/jobs/{task_id}").json()["state"] == "succeeded"
        events = list(sse_events(client, f"/jobs/{seeded.succeeded[0]}/events"))  # a final state ends the stream
        assert [(event, data["state"]) for event, data in events] == [("status", "succeeded")]
        for task_id in seeded.queued:
            assert client.get(f"/jobs/{task_id}").json()["state"] == "queued"

        dead = client.get("/dlq")
        assert dead.status_code == 200, dead.text
        assert sorted(row["id"] for row in dead.json()) == sorted(seeded.dead)

        running = _page(client, "email", "running")
        assert sorted(row["id"] for row in running["jobs"]) == ["e-0", "e-1"]
        counts = running["counts"]
        assert counts["webhooks"]["waiting"] == 3 and counts["email"]["running"] == 2
        assert counts["pdf"]["dead_lettered"] == len(seeded.dead)
        assert counts["transcode"]["scheduled"] == 1 and counts["webhooks"]["succeeded"] == len(seeded.succeeded)
        assert [row["id"] for row in _page(client, "transcode", "scheduled")["jobs"]] == ["t-1"]
        done = _page(client, "webhooks", "succeeded")
        assert sorted(row["id"] for row in done["jobs"]) == sorted(seeded.succeeded)
        waiting = _page(client, "webhooks", "waiting")
        assert {row["id"] for row in waiting["jobs"]} == {"w-1", "w-2", "w-3"}
        assert {row["id"] for row in _page(client, "pdf", "waiting")["jobs"]} == {"p-1", "p-2"}


def _page(client: httpx.Client, queue: str, state: str) -> dict[str, Any]:
    reply = client.get("/jobs", params={"queue": queue, "state": state})
    assert reply.status_code == 200, reply.text
    page: dict[str, Any] = reply.json()
    return page


def test_the_exporter_reads_every_master(redis_cluster: Cluster, seeded: Seeded, work_dir: Path) -> None:
    port = free_port()
    exe = Path(sys.executable).parent / "pipeline"
    argv = [str(exe), "exporter", "--port", str(port), "--address", "127.0.0.1"]
    with (work_dir / f"exporter-cluster-{port}.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=_env(redis_cluster), stdout=log, stderr=subprocess.STDOUT)
    try:
        samples = cast(Samples, wait_for(lambda: try_scrape(port), 60, 0.2, what="the exporter's first scrape"))
        assert value(samples, "pipeline_broker_up") == 1
        assert value(samples, "pipeline_queue_depth", queue="webhooks") == 3
        assert value(samples, "pipeline_queue_depth", queue="pdf") == 2
        assert value(samples, "pipeline_queue_paused", queue="email") == 1
        assert value(samples, "pipeline_queue_paused", queue="webhooks") == 0
        assert value(samples, "pipeline_queue_in_flight") == 2
        assert value(samples, "pipeline_dlq_size") == len(seeded.dead)
        assert (value(samples, "pipeline_queue_oldest_age_seconds", queue="pdf") or 0) >= 30
        assert (value(samples, "pipeline_redis_memory_used_bytes") or 0) > 0
    finally:
        stop_process(proc, 10)


_BACKEND = """
import json, sys
from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from pipeline.celery_app import get_app
from pipeline.compat.clusterresults import ClusterBackend
backend = get_app().backend
ids = sys.argv[1:]
for n, task_id in enumerate(ids):
    backend.store_result(task_id, {"n": n}, states.SUCCESS)
metas = [backend.get_task_meta(task_id) for task_id in ids]
def refused(cls, value):  # Celery's own size check, on a limit lowered to 8 characters for the call
    limit, cls._MAX_STR_VALUE_SIZE = cls._MAX_STR_VALUE_SIZE, 8
    try:
        backend.set("too-large-" + ids[0], value)
    except BackendStoreError:
        return True
    finally:
        cls._MAX_STR_VALUE_SIZE = limit
    return False
print(json.dumps({
    "too_large": [refused(RedisBackend, "x" * 9), refused(RedisBackend, "x" * 8)],
    "too_large_written": (backend.client.get("too-large-" + ids[0]) or b"").decode(),
    "cls": isinstance(backend, ClusterBackend),
    "one": [[m["status"], m["result"]] for m in metas],
    "many": [backend.decode_result(raw)["result"] for raw in backend.mget([backend.get_key_for_task(i) for i in ids])],
}))
"""


@pytest.mark.parity
def test_results_stored_and_read_through_the_cluster_backend(redis_cluster: Cluster) -> None:
    """Celery's own `store_result`, `get_task_meta`, `mget` and `set` on the cluster backend: each result lands on the
    master serving its key's slot, reads back one by one and all at once (keys in several slots), and a value over
    Celery's size limit (`RedisBackend._MAX_STR_VALUE_SIZE`, lowered for the call) is refused as Celery's `set`
    refuses it, nothing written."""
    ids = _spread_ids(redis_cluster, 4)
    argv = [sys.executable, "-c", _BACKEND, *ids]
    done = subprocess.run(argv, cwd=ROOT, env=_env(redis_cluster), capture_output=True, text=True, timeout=60)
    client = redis_cluster.client()
    try:
        assert done.returncode == 0, done.stderr[-2000:]
        reply = json.loads(done.stdout)
        assert reply == {
            "too_large": [True, False],
            "too_large_written": "x" * 8,
            "cls": True,
            "one": [["SUCCESS", {"n": n}] for n in range(len(ids))],
            "many": [{"n": n} for n in range(len(ids))],
        }
        for task_id in ids:
            key = RESULT_KEY.format(id=task_id)
            master = redis_cluster.master_of(key_slot(key.encode())).client()
            raw = master.get(key)
            assert raw is not None and json.loads(raw)["status"] == "SUCCESS"
            assert int(master.ttl(key)) > 0, "stored with RESULT_EXPIRES, as Celery's backend stores it"
    finally:
        for task_id in ids:
            client.delete(RESULT_KEY.format(id=task_id))
        client.delete(f"too-large-{ids[0]}")
