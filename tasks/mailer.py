"""SMTP delivery (aiosmtplib): one message at a time per pooled session (`tasks.smtp_pool`), never sent twice here.

What a failure means is decided here: connection errors and SMTP 4xx replies are `TransientError`
(the job retries with backoff), 5xx replies are `PermanentError` (the job goes to the dead-letter
queue). `before_data` runs once the server took the envelope (MAIL FROM, at least one RCPT TO) and just
before DATA, so the caller can mark the point after which a send may have happened.

A session reused from an earlier message starts with RSET: a clean envelope, and proof that it is still up. When
the server dropped it while it was idle (the RSET fails, or MAIL or RCPT meet `SMTPServerDisconnected`), nothing of
this message has reached DATA: the session is closed and the message goes on once over a new one. From DATA on,
a failure is never retried here: it is the job's (a `NotDelivered`; see `tasks.email`).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from email import policy
from email.generator import BytesGenerator
from email.message import EmailMessage
from email.utils import getaddresses

import aiosmtplib

from pipeline.config import Settings
from pipeline.errors import PermanentError, TransientError
from tasks import smtp_pool


class NotDelivered(Exception):
    """Marker base: the server did not take the message (the failure happened before or instead of delivery)."""


class SmtpTransient(TransientError, NotDelivered):
    pass


class SmtpPermanent(PermanentError, NotDelivered):
    pass


class _Stale(Exception):
    """A reused session turned out closed before anything of the message reached DATA."""


@dataclass(frozen=True)
class Envelope:
    sender: str
    recipients: list[str]
    #: The message as sent: no Bcc header, CRLF line ends.
    data: bytes
    #: An address is not ASCII: the server must offer SMTPUTF8.
    international: bool

    @classmethod
    def of(cls, message: EmailMessage, recipients: list[str]) -> Envelope:
        """What smtplib's `send_message` sent: the sender from the Sender or From header, Bcc never shown."""
        sender = getaddresses([str(message["Sender"] or message["From"])])[0][1]
        international = not all(address.isascii() for address in (sender, *recipients))
        shown = copy.copy(message)
        del shown["Bcc"]
        del shown["Resent-Bcc"]
        with io.BytesIO() as out:
            BytesGenerator(out, policy=policy.SMTPUTF8 if international else None).flatten(shown, linesep="\r\n")
            return cls(sender, recipients, out.getvalue(), international)


def classify(exc: BaseException) -> Exception:
    """The pipeline error for an aiosmtplib/socket error."""
    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        codes = [refused.code for refused in exc.recipients]
        detail = "; ".join(f"{refused.recipient}: {refused.code} {refused.message!r}" for refused in exc.recipients)
        if any(400 <= code < 500 for code in codes):
            return SmtpTransient(f"recipients refused for now: {detail}")
        return SmtpPermanent(f"recipients refused: {detail}")
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        message = f"SMTP {exc.code}: {exc.message!r}"
        return SmtpTransient(message) if 400 <= exc.code < 500 else SmtpPermanent(message)
    if isinstance(exc, aiosmtplib.SMTPNotSupported):
        return SmtpPermanent(f"SMTP server lacks an extension the settings or the message need: {exc}")
    if isinstance(exc, OSError):  # aiosmtplib's disconnects and timeouts are ConnectionError and TimeoutError
        return SmtpTransient(f"SMTP connection failed: {exc}")
    return SmtpTransient(f"SMTP error: {exc}")


async def send(
    settings: Settings, message: EmailMessage, recipients: list[str], before_data: Callable[[], None] = lambda: None
) -> list[str]:
    """Deliver `message` to `recipients`; return the accepted ones. Raises SmtpTransient / SmtpPermanent.

    `before_data` is called on the event loop (it must be quick); what it raises goes to the caller as it is.
    """
    envelope = Envelope.of(message, recipients)
    pool = smtp_pool.pool(settings)
    async with pool.slot():
        session = pool.idle()
        if session is not None:
            try:
                return await _transaction(pool, session, envelope, before_data, reused=True)
            except _Stale:
                pass  # nothing of this message reached DATA: once more, over a new session
        try:
            session = await pool.connect()
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise classify(exc) from exc
        return await _transaction(pool, session, envelope, before_data, reused=False)


async def _transaction(
    pool: smtp_pool.Pool,
    session: aiosmtplib.SMTP,
    envelope: Envelope,
    before_data: Callable[[], None],
    *,
    reused: bool,
) -> list[str]:
    """One mail transaction on `session`, which goes back to `pool` after it (closed if its state is unknown)."""
    stage = "rset" if reused else "envelope"
    try:
        if reused:
            await session.rset()
            stage = "envelope"
        refused = await _mail_and_rcpt(session, envelope)
        stage = "data"
        before_data()
        await session.data(envelope.data)
    except BaseException as exc:
        answered = stage != "rset" and isinstance(
            exc, aiosmtplib.SMTPResponseException | aiosmtplib.SMTPRecipientsRefused
        )
        if answered:  # the server refused in words: the session is sound (the next message's RSET clears it)
            pool.give_back(session)
        else:
            pool.discard(session)
        smtp_error = isinstance(exc, aiosmtplib.SMTPException | OSError)
        dropped = stage == "rset" or isinstance(exc, aiosmtplib.SMTPServerDisconnected)
        if reused and stage != "data" and smtp_error and dropped:
            raise _Stale from exc
        if smtp_error:
            raise classify(exc) from exc
        raise
    pool.give_back(session)
    return [r for r in envelope.recipients if r not in refused]


async def _mail_and_rcpt(session: aiosmtplib.SMTP, envelope: Envelope) -> set[str]:
    """MAIL FROM and RCPT TO as smtplib's `sendmail`: the refused recipients; SMTPRecipientsRefused if all are."""
    options = [f"size={len(envelope.data)}"] if session.supports_extension("size") else []
    encoding = "ascii"
    if envelope.international:
        if not session.supports_extension("smtputf8"):
            raise aiosmtplib.SMTPNotSupported("an address is not ASCII and the server does not offer SMTPUTF8")
        options += ["SMTPUTF8", "BODY=8BITMIME"]
        encoding = "utf-8"
    await session.mail(envelope.sender, options=options, encoding=encoding)
    refused: list[aiosmtplib.SMTPRecipientRefused] = []
    for recipient in envelope.recipients:
        try:
            await session.rcpt(recipient, encoding=encoding)
        except aiosmtplib.SMTPRecipientRefused as exc:
            refused.append(exc)
    if len(refused) == len(envelope.recipients):
        raise aiosmtplib.SMTPRecipientsRefused(refused)
    return {exc.recipient for exc in refused}
