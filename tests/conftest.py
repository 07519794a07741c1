"""Session set-up: a throwaway redis-server and an SMTP server on free ports, and the environment every process reads.

Redis starts in `pytest_configure`, before any test module imports `pipeline` (which reads settings
at import). It is stopped by PID when the session ends. Tests never flush the database (that would
delete kombu's bindings under a running worker); they use their own keys and the `clean_dlq` fixture.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    server = RedisServer(base / "redis").start()
    smtp = SmtpServer(free_port()).start()
    _state.update(base=base, redis=server, smtp=smtp)
    os.environ.update(TEST_ENV)
    os.environ.update(SMTP_HOST="127.0.0.1", SMTP_PORT=str(smtp.port), SMTP_SECURITY="none")
    os.environ["SMTP_FROM"] = "Pipeline Tests <tests@pipeline.test>"
    os.environ["MEDIA_ROOT"] = str(base / "media")
    os.environ["REDIS_URL"] = server.url
    os.environ["DATA_DIR"] = str(base / "data")
    os.environ.pop("RESULT_BACKEND_URL", None)
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("CELERY_RESULT_BACKEND", None)


def pytest_unconfigure(config: pytest.Config) -> None:
    smtp = _state.get("smtp")
    if isinstance(smtp, SmtpServer):
        smtp.stop()
    server = _state.get("redis")
    if isinstance(server, RedisServer):
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    server = _state["redis"]
    assert isinstance(server, RedisServer)
    return server


@pytest.fixture(scope="session")
def smtp_server() -> SmtpServer:
    """The aiosmtpd server every worker delivers to (SMTP_HOST/SMTP_PORT point at it)."""
    smtp = _state["smtp"]
    assert isinstance(smtp, SmtpServer)
    return smtp


@pytest.fixture(scope="session")
def work_dir() -> Path:
    base = _state["base"]
    assert isinstance(base, Path)
    return base


@pytest.fixture(scope="session")
def session_worker(work_dir: Path) -> Iterator[Worker]:
    """One prefork worker (concurrency 2) on every work queue, shared by the integration tests."""
    worker = Worker("session", work_dir / "logs", {}).start()
    yield worker
    worker.stop()


DLQ_KEYS = ("dead_letter", "pipeline:dlq:index", "pipeline:dlq:tasks")


@pytest.fixture
def clean_dlq(redis_server: RedisServer) -> Iterator[None]:
    """An empty dead-letter queue and index before and after the test."""
    client = redis_server.client()
    client.delete(*DLQ_KEYS)
    yield
    client.delete(*DLQ_KEYS)


@pytest.fixture
def make_worker(work_dir: Path) -> Iterator[object]:
    """Start extra workers for one test; all are stopped (by PID) when it ends."""
    started: list[Worker] = []

    def make(name: str, env: dict[str, str] | None = None, **kwargs: object) -> Worker:
        worker = Worker(name, work_dir / "logs", env or {}, **kwargs)  # type: ignore[arg-type]
        started.append(worker)
        return worker.start()

    yield make
    for worker in started:
        worker.stop()
