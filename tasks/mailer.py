"""SMTP delivery: one connection per worker process, reused across jobs and reopened when it breaks.

What a failure means is decided here: connection errors and SMTP 4xx replies are `TransientError`
(the job retries with backoff), 5xx replies are `PermanentError` (the job goes to the dead-letter
queue). `before_data` runs once the connection is up and just before the message is handed over, so
the caller can mark the point after which a send may have happened.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import smtplib
import ssl
from collections.abc import Callable
from email.message import EmailMessage

from pipeline.config import Settings
from pipeline.errors import PermanentError, TransientError

_connection: smtplib.SMTP | None = None
_owner_pid: int | None = None


class NotDelivered(Exception):
    """Marker base: the server did not take the message (the failure happened before or instead of delivery)."""


class SmtpTransient(TransientError, NotDelivered):
    pass


class SmtpPermanent(PermanentError, NotDelivered):
    pass


def _open(settings: Settings) -> smtplib.SMTP:
    host, port, timeout = settings.smtp_host, settings.smtp_port_or_default, settings.smtp_timeout
    ca_file = settings.smtp_tls_ca_file
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    conn: smtplib.SMTP
    if settings.smtp_security == "tls":
        conn = smtplib.SMTP_SSL(host, port, timeout=timeout, context=context)
    else:
        conn = smtplib.SMTP(host, port, timeout=timeout)
        if settings.smtp_security == "starttls":
            conn.starttls(context=context)
    if settings.smtp_username and settings.smtp_password is not None:
        conn.login(settings.smtp_username, settings.smtp_password.get_secret_value())
    return conn


def _alive(conn: smtplib.SMTP) -> bool:
    try:
        return conn.noop()[0] == 250
    except (smtplib.SMTPException, OSError):
        return False


def close() -> None:
    """Close this process's connection, if any."""
    global _connection
    if _connection is not None:
        with contextlib.suppress(smtplib.SMTPException, OSError):
            _connection.quit()
        _connection = None


def connection(settings: Settings) -> smtplib.SMTP:
    """This process's SMTP connection: the open one if it still answers NOOP, else a new one."""
    global _connection, _owner_pid
    if _connection is not None and (_owner_pid != os.getpid() or not _alive(_connection)):
        _connection = None  # inherited across fork, or dropped by the server
    if _connection is None:
        _connection, _owner_pid = _open(settings), os.getpid()
    return _connection


def classify(exc: BaseException) -> Exception:
    """The pipeline error for an smtplib/socket error."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _ in exc.recipients.values()]
        detail = "; ".join(f"{rcpt}: {code} {msg!r}" for rcpt, (code, msg) in exc.recipients.items())
        if any(400 <= code < 500 for code in codes):
            return SmtpTransient(f"recipients refused for now: {detail}")
        return SmtpPermanent(f"recipients refused: {detail}")
    if isinstance(exc, smtplib.SMTPResponseException):
        message = f"SMTP {exc.smtp_code}: {exc.smtp_error!r}"
        return SmtpTransient(message) if 400 <= exc.smtp_code < 500 else SmtpPermanent(message)
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return SmtpPermanent(f"SMTP server lacks an extension the settings need (STARTTLS, AUTH): {exc}")
    if isinstance(exc, smtplib.SMTPServerDisconnected | OSError):
        return SmtpTransient(f"SMTP connection failed: {exc}")
    return SmtpTransient(f"SMTP error: {exc}")


def send(
    settings: Settings, message: EmailMessage, recipients: list[str], before_data: Callable[[], None] = lambda: None
) -> list[str]:
    """Deliver `message` to `recipients`; return the accepted ones. Raises SmtpTransient / SmtpPermanent."""
    try:
        conn = connection(settings)
    except (smtplib.SMTPException, OSError) as exc:
        raise classify(exc) from exc
    before_data()
    try:
        refused = conn.send_message(message, to_addrs=recipients)
    except (smtplib.SMTPException, OSError) as exc:
        if isinstance(exc, smtplib.SMTPServerDisconnected | OSError):
            close()
        raise classify(exc) from exc
    return [r for r in recipients if r not in refused]


atexit.register(close)
