"""The shipped `invoice` flow on a real worker and a real SMTP server: the rendered PDF arrives attached to one
email; when the server refuses, the email step dead-letters, and its replay sends the email without rendering
again."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pipeline.control.flows import FlowState, FlowStatus, flow_status
from pipeline.dlq import admin as dlq
from pipeline.flows import start
from pipeline.status import JobState
from pipeline.storage import get_storage
from tests.support.procs import wait_for
from tests.support.smtp import SmtpServer
from tests.unit.test_pdf import INVOICE

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("session_worker")]


def _until(flow_id: str, state: FlowState) -> FlowStatus:
    wait_for(lambda: flow_status(flow_id).state is state, 60, 0.05, what=f"flow {flow_id} {state}")
    return flow_status(flow_id)


def _pdf_of(status: FlowStatus) -> tuple[str, Any]:
    """The render step's job id and the PDF it stored (its storage key and its stat)."""
    render = next(s for s in status.steps if s.name == "render").items[0]
    (stored,) = get_storage().list(f"pdf/{render.id}/")
    return render.id, stored


def test_an_invoice_is_rendered_and_emailed_with_the_pdf_attached(smtp_server: SmtpServer) -> None:
    to = f"invoice-{uuid.uuid4().hex[:10]}@example.com"
    flow_id = start("invoice", {"invoice": INVOICE, "to": [to]})
    done = _until(flow_id, FlowState.SUCCEEDED)

    (received,) = smtp_server.recorder.delivered_to(to)
    (attachment,) = received.message.iter_attachments()
    _, stored = _pdf_of(done)
    assert attachment.get_content_type() == "application/pdf"
    assert attachment.get_filename() == f"invoice-{INVOICE['number']}.pdf"
    assert attachment.get_payload(decode=True) == get_storage().read_bytes(stored.key, 1 << 22)
    assert f"invoice {INVOICE['number']}" in str(received.message.get_body(("plain",)).get_content())  # type: ignore[union-attr]


@pytest.mark.usefixtures("clean_dlq")
def test_a_refused_email_dead_letters_and_its_replay_sends_without_rendering_again(smtp_server: SmtpServer) -> None:
    to = f"refused-{uuid.uuid4().hex[:10]}@example.com"
    smtp_server.recorder.refusing.add(to)
    flow_id = start("invoice", {"invoice": INVOICE, "to": [to]})
    failed = _until(flow_id, FlowState.FAILED)
    assert failed.failed_step == "email"
    assert [s.state for s in failed.steps] == [JobState.SUCCEEDED, JobState.DEAD_LETTERED]
    render_id, stored = _pdf_of(failed)
    email_job = failed.steps[1].items[0].id
    entry = dlq.find(email_job)
    assert entry is not None and entry.row().flow == f"invoice {flow_id} email"
    assert smtp_server.recorder.delivered_to(to) == []

    smtp_server.recorder.refusing.discard(to)
    dlq.replay(entry.id)
    done = _until(flow_id, FlowState.SUCCEEDED)
    assert _pdf_of(done) == (render_id, stored)  # the same render, its PDF untouched: not rendered again
    (received,) = smtp_server.recorder.delivered_to(to)
    (attachment,) = received.message.iter_attachments()
    assert attachment.get_payload(decode=True) == get_storage().read_bytes(stored.key, 1 << 22)
    assert smtp_server.recorder.attempts[to] == 2  # refused once, sent once
