"""Session set-up: the environment every process reads, then services started on first use.

`pytest_configure` only writes the environment (free ports for Redis and SMTP picked now, because settings
and the Celery app are cached per process and must see REDIS_URL from their first use). The throwaway
redis-server and the SMTP server start when a test first needs them: the integration, fault and browser
tests do (their packages' conftest asks for `services`), unit tests never. Everything started is stopped
by PID when the session ends. Tests never flush the database (that would delete kombu's bindings under a
running worker); they use their own keys and the `clean_dlq` fixture.
"""

from __future__ import annotations

import gc
import os
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest
from celery import Celery

from pipeline.constants import TRANSCODE_QUEUE, WORK_QUEUES
from tests.support.cluster import Cluster
from tests.support.inproc import InProcessWorker
from tests.support.procs import RedisServer, Worker, free_port
from tests.support.smtp import SmtpServer

_state: dict[str, object] = {}

#: Settings every test process and worker shares: fast retries, quick unacked sweeps, bounded shutdown.
TEST_ENV = {
    "ENV_FILE": "",
    "SECRETS_DIR": "/nonexistent",
    "RETRY_BASE_DELAY": "0.3",
    "RETRY_JITTER": "0.05",
    "RETRY_MAX_DELAY": "10",
    "UNACKED_RESTORE_INTERVAL": "1",
    "WORKER_SOFT_SHUTDOWN_TIMEOUT": "5",
    "REMAP_SIGTERM": "SIGQUIT",
    "LOG_LEVEL": "INFO",
    # Webhook tests post to HTTP servers on 127.0.0.1 (allowlisted; everything else private stays refused).
    "WEBHOOK_SIGNING_SECRET": "test-webhook-secret",
    "WEBHOOK_ALLOWED_HOSTS": '["127.0.0.1/32"]',
}


def pytest_configure(config: pytest.Config) -> None:
    base = Path(tempfile.mkdtemp(prefix="pipeline-tests-"))
    redis_port, smtp_port = free_port(), free_port()
    _state.update(base=base, redis_port=redis_port, smtp_port=smtp_port)
    os.environ.update(TEST_ENV)
    os.environ.update(SMTP_HOST="127.0.0.1", SMTP_PORT=str(smtp_port), SMTP_SECURITY="none")
    os.environ["SMTP_FROM"] = "Pipeline Tests <tests@pipeline.test>"
    os.environ["MEDIA_ROOT"] = str(base / "media")
    os.environ["REDIS_URL"] = RedisServer(base / "redis", redis_port).url
    os.environ["DATA_DIR"] = str(base / "data")
    os.environ.pop("RESULT_BACKEND_URL", None)
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("CELERY_RESULT_BACKEND", None)


#: The fixtures that start a Redis Cluster: a test using one is marked `cluster`.
CLUSTER_FIXTURES = {"redis_cluster", "cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on a Redis Cluster is marked `cluster`. Schemathesis names its items per API operation but gives them
    all one node id; pytest-xdist tells tests apart by node id (and would run one of them), so each gets the id its
    name says."""
    from _pytest.nodeid import NodeId  # pytest 9 keeps the id here (private, hence the check below)

    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)  # `make test-cluster`, a CI step of its own
        parent, _, last = item.nodeid.rpartition("::")
        if parent and last != item.name:
            item._id = NodeId.parse(f"{parent}::{item.name}")
            assert item.nodeid.endswith(item.name), item.nodeid


@pytest.fixture(scope="session")
def work_dir() -> Path:
    base = _state["base"]
    assert isinstance(base, Path)
    return base


@pytest.fixture(scope="session")
def redis_server(work_dir: Path) -> Iterator[RedisServer]:
    """The session's redis-server (REDIS_URL points at it), started by the first test that needs it."""
    port = _state["redis_port"]
    assert isinstance(port, int)
    server = RedisServer(work_dir / "redis", port).start()
    yield server
    gc.collect()  # results waited on unsubscribe when collected: while Redis still answers
    server.stop()


@pytest.fixture(scope="session")
def smtp_server() -> Iterator[SmtpServer]:
    """The aiosmtpd server every worker delivers to (SMTP_HOST/SMTP_PORT point at it)."""
    port = _state["smtp_port"]
    assert isinstance(port, int)
    smtp = SmtpServer(port).start()
    yield smtp
    smtp.stop()


@pytest.fixture(scope="session")
def services(redis_server: RedisServer, smtp_server: SmtpServer) -> None:
    """Redis and SMTP up: what every integration, fault and browser test runs against."""


@pytest.fixture(scope="session")
def session_worker(services: None, work_dir: Path) -> Iterator[InProcessWorker]:
    """A worker in the test process on every work queue but transcode, shared by the integration tests."""
    worker = InProcessWorker("session", work_dir / "logs", [q for q in WORK_QUEUES if q != TRANSCODE_QUEUE])
    worker.start()
    _state["session_worker"] = worker
    yield worker
    _state.pop("session_worker", None)
    worker.stop()


@pytest.fixture(scope="session")
def transcode_worker(services: None, work_dir: Path) -> Iterator[Worker]:
    """A prefork worker (concurrency 2) on the transcode queue: revoke kills a pool child, time limits apply."""
    # The embedded session worker releases due delayed jobs for every queue; this one polls rarely, so a
    # test that races releasers of its own (`no_background_releaser`) is all but alone.
    worker = Worker("transcode", work_dir / "logs", {"DELAYED_POLL_INTERVAL": "60"}, queues=TRANSCODE_QUEUE)
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def own_redis(work_dir: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop and restart (AOF in its directory survives a restart on the
    same port)."""
    server = RedisServer(work_dir / f"outage-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()


@pytest.fixture
def producer(own_redis: RedisServer) -> Iterator[Celery]:
    """A plain Celery client on this test's own Redis (what a foreign producer sends)."""
    app = Celery("foreign-producer", broker=own_redis.url, backend=own_redis.url, set_as_current=False)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    yield app
    app.close()


@pytest.fixture
def ledger_redis(work_dir: Path) -> Iterator[RedisServer]:
    """Where ledger jobs record their attempts and completions: never stopped, so the record is whole."""
    server = RedisServer(work_dir / f"ledger-redis-{uuid.uuid4().hex[:6]}").start()
    yield server
    server.stop()


@pytest.fixture
def no_background_releaser() -> Iterator[None]:
    """Pause this process's delayed-job releaser (the embedded worker's) for a test that races its own."""
    from pipeline.scheduling import delayed

    running = delayed._releaser is not None
    delayed.stop_releaser()
    yield
    if running:
        delayed.start_releaser()


DLQ_KEYS = ("dead_letter", "pipeline:dlq:index", "pipeline:dlq:tasks")


@pytest.fixture
def clean_dlq(redis_server: RedisServer) -> Iterator[None]:
    """An empty dead-letter queue and index before and after the test."""
    client = redis_server.client()
    client.delete(*DLQ_KEYS)
    yield
    client.delete(*DLQ_KEYS)


#: The workers a test started (`make_worker`) and the session's worker if this process runs one: a failed test's report
#: ends with the last lines of each one's log.
_WORKERS = pytest.StashKey[list[Worker]]()
LOG_TAIL_CHARS = 4000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed:
        workers: list[Worker | InProcessWorker] = [*item.stash.get(_WORKERS, [])]
        session = _state.get("session_worker")
        if isinstance(session, InProcessWorker):
            workers.append(session)
        for worker in workers:
            report.sections.append((f"log of worker {worker.name} (its end)", worker.log()[-LOG_TAIL_CHARS:]))
    return report


@pytest.fixture
def make_worker(services: None, work_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Worker]]:
    """Start extra workers (subprocesses) for one test; all are stopped (by PID) when it ends."""
    started: list[Worker] = []
    request.node.stash[_WORKERS] = started

    def make(name: str, env: dict[str, str] | None = None, **kwargs: object) -> Worker:
        worker = Worker(name, work_dir / "logs", env or {}, **kwargs)  # type: ignore[arg-type]
        started.append(worker)
        return worker.start()

    yield make
    stop_all(started)


def stop_all(workers: list[Worker]) -> None:
    """Stop workers together: each gets its SIGTERM before any is waited for."""
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop()


@pytest.fixture(scope="session")
def _cluster_of_this_process(work_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(work_dir / "cluster").start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(_cluster_of_this_process: Cluster) -> Cluster:
    """A Redis Cluster of this test process: 3 masters and 3 replicas on loopback ports (`tests.support.cluster`),
    started by the first test that needs it, stopped by PID and its directory removed when the session ends, and
    emptied before each test (no test sees another's queues). A test that fails a master over restarts the killed
    node (`Cluster.restart`), so the next finds every slot replicated."""
    _cluster_of_this_process.flush()
    return _cluster_of_this_process
