"""email.send against a real SMTP server (aiosmtpd in the test process) and a real worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pipeline.dlq import admin as dlq_admin
from pipeline.status import job_status
from tasks.email import EmailResult, send
from tests.support.inproc import InProcessWorker
from tests.support.procs import wait_for
from tests.support.smtp import SmtpServer

pytestmark = pytest.mark.integration
WELCOME = {"name": "Ada <Lovelace>", "product": "Pipeline", "action_url": "https://example.com/start"}


def address(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}@example.com"


def payload(to: str, **extra: Any) -> dict[str, Any]:
    return {"to": [to], "template_id": "welcome", "variables": WELCOME, **extra}


def test_message_arrives_with_headers_parts_and_variables(
    session_worker: InProcessWorker, smtp_server: SmtpServer
) -> None:
    to, cc, bcc = address("user"), address("cc"), address("bcc")
    task_id = send.enqueue(payload(to, cc=[cc], bcc=[bcc], reply_to="help@example.com"))
    result = send.result(task_id, timeout=60)

    (received,) = smtp_server.recorder.delivered_to(to)
    msg = received.message
    assert msg["From"] == "Pipeline Tests <tests@pipeline.test>"
    assert received.mail_from == "tests@pipeline.test"
    assert msg["To"] == to
    assert msg["Cc"] == cc
    assert msg["Bcc"] is None  # delivered to, never shown
    assert sorted(received.rcpt_tos) == sorted([to, cc, bcc])
    assert msg["Subject"] == "Welcome to Pipeline, Ada <Lovelace>"
    assert msg["Message-ID"] == result.message_id
    text = msg.get_body(("plain",))
    html = msg.get_body(("html",))
    assert text is not None
    assert html is not None
    assert "Hello Ada <Lovelace>," in text.get_content()
    assert "Hello Ada &lt;Lovelace&gt;," in html.get_content()
    assert 'href="https://example.com/start"' in html.get_content()
    assert sorted(result.recipients) == sorted([to, cc, bcc])
    assert result.sent_at.tzinfo is not None


def test_connection_is_reused_across_jobs(session_worker: InProcessWorker, smtp_server: SmtpServer) -> None:
    before = smtp_server.recorder.connections
    for _ in range(5):
        send.result(send.enqueue(payload(address("reuse"))), timeout=60)
    # Two pool processes, each reopening at most once (an earlier test's 421 closed its connection).
    assert smtp_server.recorder.connections > 0  # the server does count connections
    assert smtp_server.recorder.connections - before <= 2


def test_421_twice_then_accepted_delivers_exactly_once(
    session_worker: InProcessWorker, smtp_server: SmtpServer
) -> None:
    to = address("flaky")
    task_id = send.enqueue(payload(to))
    send.result(task_id, timeout=60)
    assert smtp_server.recorder.attempts[to] == 3
    assert len(smtp_server.recorder.delivered_to(to)) == 1
    assert job_status(task_id).attempts == 3


@pytest.mark.usefixtures("clean_dlq")
def test_550_is_permanent_one_attempt_and_dead_lettered(
    session_worker: InProcessWorker, smtp_server: SmtpServer
) -> None:
    to = address("reject")
    task_id = send.enqueue(payload(to))
    entry: Any = wait_for(lambda: _dead_letter(task_id), 60, 0.2, what="the DLQ entry")
    assert entry.exception_type.endswith("SmtpPermanent")
    assert "550" in entry.exception_message
    assert entry.attempts == 1
    assert entry.payload["to"] == [to]
    assert smtp_server.recorder.attempts[to] == 1
    assert smtp_server.recorder.delivered_to(to) == []


def _dead_letter(task_id: str) -> object:
    try:
        return dlq_admin.get(task_id)
    except dlq_admin.DeadLetterNotFound:
        return None


def test_redelivered_job_sends_once(session_worker: InProcessWorker, smtp_server: SmtpServer) -> None:
    """The same message delivered twice (same task id), as after a worker crash: one email."""
    to = address("redelivered")
    task_id = str(uuid.uuid4())
    for _ in range(2):
        send.task.apply_async((payload(to),), task_id=task_id)
    done = f"email.send[{task_id}] succeeded"
    wait_for(lambda: session_worker.log().count(done) == 2, 60, 0.2, what="both deliveries to finish")
    assert len(smtp_server.recorder.delivered_to(to)) == 1
    assert smtp_server.recorder.attempts[to] == 1


def test_same_idempotency_key_in_two_jobs_sends_once(session_worker: InProcessWorker, smtp_server: SmtpServer) -> None:
    to, key = address("keyed"), uuid.uuid4().hex
    first = send.result(send.enqueue(payload(to, idempotency_key=key)), timeout=60)
    second_id = send.enqueue(payload(to, idempotency_key=key))
    second: EmailResult = send.result(second_id, timeout=60)
    assert second == first  # the stored result of the first send
    assert len(smtp_server.recorder.delivered_to(to)) == 1
