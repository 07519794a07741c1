"""email.send on a real asyncio-pool worker (`-P custom`, `pipeline.runtime.asyncpool`): many jobs in flight in one
process share its pool of SMTP sessions, which end with QUIT when the worker stops."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from pipeline.runtime.asyncpool import POOL
from tasks.email import send
from tests.support.procs import Worker, free_port
from tests.support.smtp import SmtpServer

pytestmark = pytest.mark.integration
JOBS, SESSIONS = 30, 3


def test_jobs_in_flight_on_one_worker_share_its_smtp_sessions(work_dir: Path, spare_queue: str) -> None:
    server = SmtpServer(free_port()).start()
    server.recorder.data_delay = 0.1  # each DATA takes a while: the jobs in flight overlap
    env = {"CELERY_CUSTOM_WORKER_POOL": POOL, "SMTP_PORT": str(server.port), "SMTP_POOL_SIZE": str(SESSIONS)}
    worker = Worker("email-aio", work_dir / "logs", env, queues=spare_queue, pool="custom", concurrency=JOBS)
    try:
        worker.start()
        addresses = [f"aio-{uuid.uuid4().hex[:10]}@example.com" for _ in range(JOBS)]
        payloads = [{"to": [to], "template_id": "welcome", "variables": {"name": "Ada", "product": "P",
                     "action_url": "https://example.com"}} for to in addresses]  # fmt: skip
        task_ids = [send.task.apply_async((p,), queue=spare_queue).id for p in payloads]
        results = [send.result(task_id, timeout=60) for task_id in task_ids]
        assert [r.recipients for r in results] == [[to] for to in addresses]
        assert all(len(server.recorder.delivered_to(to)) == 1 for to in addresses)
        assert server.recorder.open_max == SESSIONS  # the bound held, and jobs overlapped enough to reach it
        assert server.recorder.connections == SESSIONS
    finally:
        worker.stop()
        server.stop()
    assert server.recorder.quits == SESSIONS  # closed at the worker's stop (close_loop_resources)
