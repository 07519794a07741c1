"""`celery -A pipeline flower`: refuses to run open, enforces FLOWER_BASIC_AUTH, shows tasks that ran; on a cluster URL,
its queue lengths."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flower.utils.broker import Redis as FlowerRedis

from pipeline.constants import WORK_QUEUES
from pipeline.queues import keys
from tasks.probe import probe
from tests.support.cluster import Cluster
from tests.support.procs import ROOT, RedisServer, free_port, wait_for

pytestmark = pytest.mark.integration
CREDENTIALS = "ops:s3cret-flower-pw"


def _flower(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    import os

    argv = [sys.executable, "-m", "celery", "-A", "pipeline", "flower", f"--port={port}", "--address=127.0.0.1"]
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _get(port: int, path: str, credentials: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if credentials:
        request.add_header("Authorization", "Basic " + base64.b64encode(credentials.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310  # http to loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def flower(work_dir: Path) -> Iterator[int]:
    port = free_port()
    proc = _flower(port, {"FLOWER_BASIC_AUTH": CREDENTIALS}, work_dir / "flower.log")
    try:
        wait_for(lambda: _get(port, "/healthcheck")[0] == 200, 30, 0.2, what="flower to listen")
        yield port
    finally:
        _stop(proc)


def test_flower_requires_auth_and_lists_a_task_that_ran(flower: int, make_worker: Any) -> None:
    status, _ = _get(flower, "/api/tasks")
    assert status == 401
    assert _get(flower, "/api/tasks", "ops:wrong")[0] == 401
    # A worker as deployed: task events off (TASK_EVENTS unset) until Flower's `enable_events` arrives.
    queue = f"flower-{uuid.uuid4().hex[:6]}"
    make_worker("flower", queues=queue, concurrency=1)

    ids: list[str] = []

    def listed() -> dict[str, object] | None:
        ids.append(probe.task.apply_async(({"message": "flower"},), queue=queue).id)
        probe.task.AsyncResult(ids[-1]).get(timeout=30)
        status, body = _get(flower, "/api/tasks", CREDENTIALS)
        assert status == 200
        tasks = json.loads(body)
        # A task whose first events Flower missed has no name; its success event may still be on its way.
        seen = [tasks[i] for i in ids if i in tasks and tasks[i].get("name") and tasks[i]["state"] == "SUCCESS"]
        return seen[0] if seen else None

    # Flower only knows tasks whose events it received: retry until its event receiver is connected.
    task = wait_for(listed, 60, 0.5, what="Flower to list a task that ran")
    assert isinstance(task, dict)
    assert task["name"] == "pipeline.probe"
    assert task["state"] == "SUCCESS"


@pytest.mark.parametrize(
    ("auth", "message"),
    [("", "refuses to start without authentication"), ("no-colon", "must be user:password")],
)
def test_flower_refuses_to_start_without_auth(auth: str, message: str, work_dir: Path) -> None:
    port = free_port()
    log = work_dir / "flower-refused.log"
    proc = _flower(port, {"FLOWER_BASIC_AUTH": auth}, log)
    try:
        code = proc.wait(30)
    finally:
        _stop(proc)
    assert code == 2, log.read_text()
    assert message in log.read_text()
    assert _get(port, "/healthcheck")[0] == 0, "nothing listens"


def test_flower_development_flag_allows_an_open_ui(work_dir: Path) -> None:
    port = free_port()
    proc = _flower(port, {"FLOWER_BASIC_AUTH": "", "FLOWER_UNAUTHENTICATED": "true"}, work_dir / "flower-open.log")
    try:
        wait_for(lambda: _get(port, "/healthcheck")[0] == 200, 30, 0.2, what="flower to listen")
        assert _get(port, "/")[0] == 200
    finally:
        _stop(proc)


@pytest.mark.parity
def test_flower_on_a_cluster_url_shows_queue_lengths_as_on_a_single_redis(
    redis_cluster: Cluster, ledger_redis: RedisServer, work_dir: Path
) -> None:
    """Its broker view on a cluster (`pipeline.compat.flowerbroker`) answers as Flower's own Redis client answers
    for the same jobs on a single Redis; its UI and API answer behind its auth."""
    queue, levels = WORK_QUEUES[-1], {0: 2, 1: 1, 3: 3}  # jobs per priority level (index into the level list)
    single, clustered = ledger_redis.client(), redis_cluster.client()
    clustered.delete(*keys.levels(queue, True))
    for index, count in levels.items():
        single.lpush(keys.levels(queue, False)[index], *[f"job-{n}" for n in range(count)])
        clustered.lpush(keys.levels(queue, True)[index], *[f"job-{n}" for n in range(count)])
    theirs = asyncio.run(FlowerRedis(ledger_redis.url).queues([queue]))

    port = free_port()
    log = work_dir / "flower-cluster.log"
    proc = _flower(port, {"REDIS_URL": redis_cluster.url(), "FLOWER_BASIC_AUTH": CREDENTIALS}, log)
    try:
        wait_for(lambda: _get(port, "/healthcheck")[0] == 200, 60, 0.2, what="flower to listen on a cluster URL")
        assert _get(port, "/api/queues/length")[0] == 401
        status, body = _get(port, "/api/queues/length", CREDENTIALS)
        assert status == 200, body[:500]
        ours = [q for q in json.loads(body)["active_queues"] if q["name"] == queue]
        assert ours == theirs == [{"name": queue, "messages": sum(levels.values())}]
        for path in ("/api/workers", "/api/tasks", "/broker"):
            assert _get(port, path, CREDENTIALS)[0] == 200, path
    finally:
        _stop(proc)
        clustered.delete(*keys.levels(queue, True))
    text = log.read_text()
    assert "Flower on a Redis Cluster" not in text  # a verified Flower: the broker view is installed, no warning
    assert "Traceback" not in text


def test_flower_on_a_cluster_url_lists_a_cluster_worker_and_a_task_that_ran(
    redis_cluster: Cluster, ledger_redis: RedisServer, work_dir: Path, make_worker: Any
) -> None:
    """Celery's events and control replies reach Flower over the cluster transport's pub/sub fanout and reply
    lists: Flower lists a worker on the cluster and a task it ran."""
    import os

    env = {
        "REDIS_URL": redis_cluster.url(),
        "RESULT_BACKEND_URL": ledger_redis.url,
        "TEST_LEDGER_URL": ledger_redis.url,
    }
    node = f"flower-cl-{uuid.uuid4().hex[:6]}"
    make_worker(node, env=env, queues="default", concurrency=1)
    port = free_port()
    proc = _flower(port, {**env, "FLOWER_BASIC_AUTH": CREDENTIALS}, work_dir / "flower-cluster-events.log")
    key = uuid.uuid4().hex
    sent: list[str] = []

    def listed() -> bool:
        produced = subprocess.run(
            [sys.executable, "-m", "tests.support.cluster_producer", "send", "default", key, "1", "0"],
            cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        sent.extend(json.loads(produced.stdout.strip().splitlines()[-1])["ids"])
        workers = json.loads(_get(port, "/api/workers", CREDENTIALS)[1] or b"{}")
        tasks = json.loads(_get(port, "/api/tasks", CREDENTIALS)[1] or b"{}")
        ran = [tasks[i] for i in sent if i in tasks and tasks[i].get("state") == "SUCCESS"]
        return any(name.startswith(f"{node}@") for name in workers) and bool(ran)

    try:
        wait_for(lambda: _get(port, "/healthcheck")[0] == 200, 60, 0.2, what="flower to listen on a cluster URL")
        wait_for(listed, 90, 1.0, what="Flower to list the cluster worker and a task it ran")
    finally:
        _stop(proc)
