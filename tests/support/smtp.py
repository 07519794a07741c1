"""A real SMTP server (aiosmtpd) in the test process that records what it receives and can misbehave on cue.

The recipient's local part picks the behaviour, so tests running against one server stay independent:
`flaky-*` answers DATA with 421 twice then accepts; `reject-*` answers 550; `hangup-*` hangs up instead of answering
DATA; anything else is accepted, except an
address a test put in `Recorder.refusing` (550 until it is taken out). The recorder also counts the connections open
at once, RSETs and QUITs, and `SmtpServer.drop_connections()` hangs up on every client, as a server's idle timeout.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field
from email import message_from_bytes, policy
from email.message import EmailMessage
from typing import Any, cast

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    message: EmailMessage
    #: Whether the session was encrypted (STARTTLS or implicit TLS).
    tls: bool = False


@dataclass
class Recorder:
    received: list[Received] = field(default_factory=list)
    #: DATA commands seen, by first recipient.
    attempts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: EHLO commands seen: one per SMTP connection a client opened.
    connections: int = 0
    #: First recipients answered 550 for now.
    refusing: set[str] = field(default_factory=set)
    #: Connections open now (their server-side protocols), and the most ever open at once.
    open_now: set[SMTP] = field(default_factory=set)
    open_max: int = 0
    rsets: int = 0
    quits: int = 0
    #: Seconds DATA waits before it answers, so that concurrent clients overlap.
    data_delay: float = 0.0

    def opened(self, protocol: SMTP) -> None:
        with self.lock:
            self.open_now.add(protocol)
            self.open_max = max(self.open_max, len(self.open_now))

    def closed(self, protocol: SMTP) -> None:
        with self.lock:
            self.open_now.discard(protocol)

    async def handle_RSET(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.rsets += 1
        return "250 OK"

    async def handle_QUIT(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.quits += 1
        return "221 Bye"

    async def handle_EHLO(
        self, server: Any, session: Any, envelope: Any, hostname: str, responses: list[str]
    ) -> list[str]:
        with self.lock:
            self.connections += 1
        session.host_name = hostname
        return responses

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        await asyncio.sleep(self.data_delay)
        first = envelope.rcpt_tos[0]
        with self.lock:
            self.attempts[first] += 1
            count = self.attempts[first]
        if first.startswith("hangup-"):
            server.transport.abort()  # the message arrived whole, and the client never hears the answer
            return "250 2.0.0 OK"
        if first.startswith("flaky-") and count <= 2:
            return "421 4.3.0 try again later"
        if first.startswith("reject-") or first in self.refusing:
            return "550 5.1.1 no such user"
        parsed = cast(EmailMessage, message_from_bytes(envelope.original_content, policy=policy.default))
        with self.lock:
            # session.ssl: STARTTLS; the transport's ssl_object: implicit TLS.
            tls = session.ssl is not None or server.transport.get_extra_info("ssl_object") is not None
            self.received.append(Received(envelope.mail_from, list(envelope.rcpt_tos), parsed, tls))
        return "250 2.0.0 OK"

    def delivered_to(self, address: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if address in r.rcpt_tos]


class _CountingSMTP(SMTP):
    """aiosmtpd's protocol, telling the recorder when its connection opens and closes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.event_handler.opened(self)

    def connection_lost(self, error: Exception | None) -> None:
        self.event_handler.closed(self)
        super().connection_lost(error)


class _Controller(Controller):
    def factory(self) -> SMTP:
        return _CountingSMTP(self.handler, **self.SMTP_kwargs)


class SmtpServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.recorder = Recorder()
        self.controller = _Controller(self.recorder, hostname="127.0.0.1", port=port)

    def start(self) -> SmtpServer:
        self.controller.start()
        return self

    def stop(self) -> None:
        self.controller.stop()

    def drop_connections(self) -> None:
        """Hang up on every client, without a word (as a server whose idle timeout passed)."""
        with self.recorder.lock:
            protocols = list(self.recorder.open_now)
        for protocol in protocols:
            if protocol.transport is not None:
                self.controller.loop.call_soon_threadsafe(protocol.transport.close)
