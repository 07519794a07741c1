"""`email.send`: render a transactional email from a template and deliver it over SMTP, once.

The payload names a template (`tasks/templates/email/<id>/`) and its variables; a missing template
or variable is refused at enqueue. Delivery is guarded by `pipeline.once`: a retry or a redelivery of
a job that already sent returns the stored result instead of sending again (see docs/tasks.md for the
one window where the outcome cannot be known, and what happens then). Attachments are objects of the
pipeline's storage backend, named by their URI (`tasks.email_attachments`), read once the send is claimed.

The task is `async def`: on the asyncio pool many sends share one event loop and the SMTP sessions of
`tasks.smtp_pool` (`tasks.mailer` holds the conversation); what blocks (attachment reads) runs in a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from email.message import EmailMessage
from email.utils import format_datetime, parseaddr

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.errors import PermanentError
from pipeline.once import Once
from pipeline.task import JobContext, typed_task
from pipeline.text import HeaderEmail, HeaderText, single_line
from tasks import email_attachments, email_templates, mailer
from tasks.email_attachments import Attachment

MAX_RECIPIENTS = 50


class EmailJob(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "to": ["ada@example.com"],
                    "template_id": "welcome",
                    "variables": {"name": "Ada", "product": "pipeline", "action_url": "https://example.com/start"},
                }
            ]
        },
    )

    to: list[HeaderEmail] = Field(min_length=1, max_length=MAX_RECIPIENTS)
    #: Overrides the template's subject; one of the two is required. One line: no line breaks or controls.
    subject: HeaderText | None = Field(default=None, min_length=1, max_length=998)
    template_id: str = Field(pattern=email_templates.TEMPLATE_ID.pattern)
    #: The template's variables; `url` and `*_url` ones must be http(s) URLs.
    variables: dict[str, str] = Field(default_factory=dict, max_length=200)
    cc: list[HeaderEmail] = Field(default_factory=list, max_length=MAX_RECIPIENTS)
    bcc: list[HeaderEmail] = Field(default_factory=list, max_length=MAX_RECIPIENTS)
    reply_to: HeaderEmail | None = None
    #: Objects of the pipeline's storage (e.g. a `pdf.render` result's `uri`), EMAIL_ATTACHMENTS_MAX_BYTES in total.
    attachments: list[Attachment] = Field(default_factory=list, max_length=email_attachments.MAX_ATTACHMENTS)
    #: Same key → sent once. Default: the job's idempotency key (the enqueue key, else the task id).
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("variables")
    @classmethod
    def _links_are_http(cls, variables: dict[str, str]) -> dict[str, str]:
        return email_templates.check_variables(variables)  # TemplateError is a ValueError

    @model_validator(mode="after")
    def _renders(self) -> EmailJob:
        if len(self.to) + len(self.cc) + len(self.bcc) > MAX_RECIPIENTS:
            raise ValueError(f"at most {MAX_RECIPIENTS} recipients in to, cc and bcc together")
        rendered = email_templates.render(self.template_id, self.variables)  # TemplateError is a ValueError
        if not (self.subject or rendered.subject):
            raise ValueError(f"template {self.template_id!r} has no subject.txt: pass a subject")
        if rendered.subject and not self.subject:
            try:
                single_line(rendered.subject)
            except ValueError as exc:  # a variable put a control character into the template's subject
                raise ValueError(f"the subject rendered from the variables: {exc}") from None
        return self

    @property
    def recipients(self) -> list[str]:
        return list(dict.fromkeys([*self.to, *self.cc, *self.bcc]))


class EmailResult(BaseModel):
    message_id: str
    #: ISO 8601, UTC.
    sent_at: datetime
    #: The recipients the server accepted.
    recipients: list[str]


def build_message(job: EmailJob, key: str, attachments: Sequence[email_attachments.Loaded] = ()) -> EmailMessage:
    """The MIME message: text + HTML alternatives, then `attachments` (multipart/mixed). Its Message-ID derives
    from `key`, so it is stable."""
    settings = get_settings()
    rendered = email_templates.render(job.template_id, job.variables)
    domain = parseaddr(settings.smtp_from)[1].rpartition("@")[2] or "localhost"
    message = EmailMessage()
    message["From"] = settings.smtp_from
    message["To"] = ", ".join(job.to)
    if job.cc:
        message["Cc"] = ", ".join(job.cc)
    if job.reply_to:
        message["Reply-To"] = job.reply_to
    message["Subject"] = job.subject or rendered.subject or ""
    message["Date"] = format_datetime(datetime.now(UTC))
    message["Message-ID"] = f"<{hashlib.sha256(key.encode()).hexdigest()[:32]}@{domain}>"
    message.set_content(rendered.text)
    message.add_alternative(rendered.html, subtype="html")
    email_attachments.attach(message, attachments)
    return message


async def deliver(job: EmailJob, ctx: JobContext) -> EmailResult:
    """Send `job` unless a job with its idempotency key already did; return what was (or had been) sent."""
    settings = get_settings()
    key = job.idempotency_key or ctx.idempotency_key
    message = build_message(job, key)
    with broker_redis() as client:
        once = Once(client, "email.send", key, ctx.task_id, settings.email_idempotency_ttl)
        stored = once.claim()
    if stored is not None:
        return EmailResult.model_validate(stored)
    try:  # read only by the job that sends: a job that already sent never touches the attachments
        loaded = await asyncio.to_thread(
            email_attachments.load, job.attachments, settings.email_attachments_max_bytes
        )  # file or S3 reads: off the event loop
        email_attachments.attach(message, loaded)
        accepted = await mailer.send(
            settings, message, job.recipients, before_data=lambda: _step(once, once.committing)
        )
    except (email_attachments.NotAttached, mailer.NotDelivered):
        _step(once, once.release)
        raise
    if not accepted:
        _step(once, once.release)
        raise PermanentError("the server accepted none of the recipients")
    result = EmailResult(message_id=str(message["Message-ID"]), sent_at=datetime.now(UTC), recipients=accepted)
    _step(once, lambda: once.done(result.model_dump(mode="json")))
    return result


def _step(once: Once, step: Callable[[], None]) -> None:
    """One step of the once-guard, on a broker connection taken for it alone.

    A job never holds one of the app's pooled broker connections across an await: with hundreds of jobs in flight on
    one event loop, each holding one while it waits on SMTP, the pool would run dry and the next job's acquire would
    block the loop. The steps run inline on the loop, not through `asyncio.to_thread`: each is one or two quick
    commands (SET NX, a compare-and-set script), one round trip to the broker (a fraction of a millisecond; about a
    hop to a thread and back), as the job's own result and acknowledgement are on the asyncio pool. They wait long
    only while Redis is unreachable, and then the worker's fetch, acknowledgements and results are stalled too.
    """
    with broker_redis() as client:
        once.client = client
        step()


@typed_task("email.send", kind="email", payload=EmailJob, result=EmailResult)
async def send(job: EmailJob, ctx: JobContext) -> EmailResult:
    """Render and deliver one email (at most once per idempotency key)."""
    return await deliver(job, ctx)


enqueue = send.enqueue
