"""`email.send` at a SIGTERM of its asyncio-pool worker: an email in the middle of SMTP DATA is finished and
acknowledged (never stopped there, to be dead-lettered as OutcomeUnknown by its next attempt), and one that had not
reached DATA is given back and sent once by the next worker. Counted at the aiosmtpd sink (`tests.support.smtp`),
two leases past the last answer."""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, env_for
from tests.support.procs import RedisServer, free_port, wait_for
from tests.support.smtp import SmtpServer

pytestmark = pytest.mark.faults

EMAILS, SESSIONS = 6, 2


def _payload(to: str) -> dict[str, Any]:
    variables = {"name": "Ada", "product": "P", "action_url": "https://example.com"}
    return {"to": [to], "template_id": "welcome", "variables": variables}


def test_sigterm_with_emails_in_data_finishes_them_and_sends_the_rest_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    server = SmtpServer(free_port()).start()
    try:
        server.recorder.data_delay = 3.0  # DATA outlasts the soft shutdown (1 s): the email is in DATA at SIGTERM
        smtp = {"SMTP_PORT": str(server.port), "SMTP_POOL_SIZE": str(SESSIONS), "WORKER_SOFT_SHUTDOWN_TIMEOUT": "1"}
        env = env_for(own_redis, ledger_redis, CELERY_CUSTOM_WORKER_POOL=POOL, **SHORT_LEASE, **smtp)
        old = make_worker(f"mail-a-{uuid.uuid4().hex[:6]}", env=env, pool="custom", concurrency=EMAILS)
        addresses = [f"term-{uuid.uuid4().hex[:10]}@example.com" for _ in range(EMAILS)]
        jobs = [str(producer.send_task("email.send", args=[_payload(to)], queue="default").id) for to in addresses]
        wait_for(lambda: len(server.recorder.open_now) == SESSIONS, 30, 0.05, what="both sessions open")
        time.sleep(0.5)  # into DATA (MAIL and RCPT are answered at once), not an assertion
        old.send_signal(signal.SIGTERM)
        make_worker(f"mail-b-{uuid.uuid4().hex[:6]}", env=env, pool="custom", concurrency=EMAILS)
        assert old.wait(30) is not None
        states = {job: producer.AsyncResult(job).get(timeout=60, propagate=False) for job in jobs}
        answered = time.monotonic()
        assert all(isinstance(result, dict) for result in states.values()), states  # SUCCESS each, none failed
        wait_for(lambda: time.monotonic() >= answered + 2 * SHORT_LEASE_S, 4 * SHORT_LEASE_S, 0.2, what="two leases")
        assert {to: len(server.recorder.delivered_to(to)) for to in addresses} == dict.fromkeys(addresses, 1)
        assert {to: server.recorder.attempts[to] for to in addresses} == dict.fromkeys(addresses, 1)  # DATA once each
        assert own_redis.client().llen("dead_letter") == 0
    finally:
        server.stop()
