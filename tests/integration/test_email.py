"""email.send against a real SMTP server (aiosmtpd in the test process) and a real worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.dlq import admin as dlq_admin
from pipeline.errors import PayloadInvalid
from pipeline.once import ONCE_KEY
from pipeline.status import job_status
from pipeline.storage import get_storage
from tasks import pdf
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


def test_a_rendered_pdf_arrives_as_an_attachment(session_worker: InProcessWorker, smtp_server: SmtpServer) -> None:
    """The invoice flow: pdf.render stores a PDF, email.send attaches it by the URI the render returned."""
    from tests.unit.test_pdf import INVOICE

    rendered = pdf.render.result(pdf.render.enqueue({"template_id": "invoice", "data": INVOICE}), timeout=60)
    storage = get_storage()
    notes_key = f"inputs/{uuid.uuid4().hex}/notes.bin"
    with storage.open_write(notes_key) as out:
        out.write(b"Zahlbar in 14 Tagen.\n")
    to = address("invoice")
    attachments = [
        {"uri": rendered.uri},
        {"uri": storage.uri(notes_key), "filename": "Hinweise März.txt", "content_type": "text/plain"},
    ]
    send.result(send.enqueue(payload(to, attachments=attachments)), timeout=60)

    (received,) = smtp_server.recorder.delivered_to(to)
    msg = received.message
    assert msg.get_content_type() == "multipart/mixed"
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "multipart/alternative",
        "application/pdf",
        "text/plain",
    ]
    body = msg.get_body(("plain",))
    assert body is not None
    assert "Hello Ada <Lovelace>," in body.get_content()
    invoice, notes = msg.iter_attachments()
    assert (invoice.get_filename(), invoice.get_content_disposition()) == ("invoice.pdf", "attachment")
    assert invoice.get_payload(decode=True) == storage.read_bytes(storage.key_for(rendered.uri) or "", 1 << 20)
    assert len(invoice.get_payload(decode=True)) == rendered.bytes
    assert (notes.get_filename(), notes.get_content_disposition()) == ("Hinweise März.txt", "attachment")
    assert notes.get_payload(decode=True) == b"Zahlbar in 14 Tagen.\n"


@pytest.mark.usefixtures("clean_dlq")
def test_an_attachment_over_the_cap_dead_letters_and_nothing_is_sent(
    session_worker: InProcessWorker, smtp_server: SmtpServer
) -> None:
    cap = get_settings().email_attachments_max_bytes
    storage = get_storage()
    key = f"pdf/{uuid.uuid4().hex}/huge.pdf"
    with storage.writing(key) as path, path.open("wb") as out:
        out.truncate(cap + 1)  # sparse: refused from its size, never read
    to = address("oversize")
    task_id = send.enqueue(payload(to, attachments=[{"uri": storage.uri(key)}]))
    entry: Any = wait_for(lambda: _dead_letter(task_id), 60, 0.2, what="the DLQ entry")
    assert entry.exception_type.endswith("AttachmentError")
    assert f"attachments[0] ({storage.uri(key)}): {cap + 1} bytes" in entry.exception_message
    assert f"over EMAIL_ATTACHMENTS_MAX_BYTES ({cap} bytes in total)" in entry.exception_message
    assert entry.attempts == 1
    assert smtp_server.recorder.attempts[to] == 0
    assert smtp_server.recorder.delivered_to(to) == []
    with broker_redis() as client:  # the send guard was released: a replay after a fix can send
        assert not client.exists(ONCE_KEY.format(task="email.send", key=task_id))


@pytest.mark.parametrize(
    "uri",
    [
        "file:///etc/passwd",
        "{root}/../../../etc/passwd",
        "{root}/pdf/%2e%2e/%2e%2e/secret.pdf",
        "{root}/.partial/half-written.pdf",
        "http://127.0.0.1:9/invoice.pdf",
        "https://example.com/invoice.pdf",
        "s3://bucket/pdf/1/invoice.pdf",
        "/etc/passwd",
    ],
)
def test_a_uri_outside_the_storage_is_refused_at_enqueue(uri: str) -> None:
    root = get_storage().uri("x").removesuffix("/x")
    with pytest.raises(PayloadInvalid, match=r"attachments\.0\.uri: .*not an object of the pipeline's storage"):
        send.enqueue(payload(address("refused"), attachments=[{"uri": uri.format(root=root)}]))
