"""Pooled SMTP sessions (aiosmtplib): per server and per event loop, at most SMTP_POOL_SIZE open at once.

A session is opened (connect, implicit TLS or STARTTLS, EHLO, AUTH) when a message finds no idle one, used by one
message at a time, and given back still open for the next. Each server's pool is a `pipeline.pools.aio.per_loop`
resource: the asyncio pool's event loop shares it among every job in flight, a solo or prefork worker's thread loop
keeps it from job to job, and `close_loop_resources` ends each idle session with QUIT when the loop's owner stops.

What a message does with a session (RSET first, when to give it back or close it) is `tasks.mailer`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiosmtplib

from pipeline.config import Settings
from pipeline.pools import aio

#: How long a worker that stops waits for the server's answer to QUIT (a stop is not held for SMTP_TIMEOUT).
QUIT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Server:
    """Where and how to open a session: everything of the settings that shapes one."""

    host: str
    port: int
    security: str
    timeout: float
    ca_file: str | None
    username: str | None
    password: str | None = field(repr=False)

    @classmethod
    def of(cls, settings: Settings) -> Server:
        password = settings.smtp_password.get_secret_value() if settings.smtp_password is not None else None
        ca_file = str(settings.smtp_tls_ca_file) if settings.smtp_tls_ca_file else None
        return cls(
            settings.smtp_host, settings.smtp_port_or_default, settings.smtp_security, settings.smtp_timeout,
            ca_file, settings.smtp_username, password,
        )  # fmt: skip

    @property
    def key(self) -> str:
        """The pool's `per_loop` key: one pool per server and login (the password only as a digest)."""
        digest = hashlib.sha256(repr((self.username, self.password, self.ca_file, self.timeout)).encode()).hexdigest()
        return f"tasks.smtp_pool:{self.security}://{self.host}:{self.port}#{digest[:16]}"


async def _open(server: Server, context: ssl.SSLContext) -> aiosmtplib.SMTP:
    """A session ready for MAIL FROM, as smtplib opened one: TLS verified by `context`, the server's lack of
    STARTTLS or AUTH when the settings need them an `SMTPNotSupported`."""
    session = aiosmtplib.SMTP(
        hostname=server.host, port=server.port, timeout=server.timeout,
        use_tls=server.security == "tls", start_tls=False, tls_context=context,
    )  # fmt: skip
    await session.connect()
    try:
        await _hello(session)
        if server.security == "starttls":
            if not session.supports_extension("starttls"):
                raise aiosmtplib.SMTPNotSupported("STARTTLS extension not supported by server.")
            await session.starttls()
            await _hello(session)  # what the server offers over TLS (RFC 3207: forget what it said before)
        if server.username and server.password is not None:
            if not session.supports_extension("auth"):
                raise aiosmtplib.SMTPNotSupported("SMTP AUTH extension not supported by server.")
            await session.login(server.username, server.password)
    except BaseException:
        session.close()
        raise
    return session


async def _hello(session: aiosmtplib.SMTP) -> None:
    """EHLO, else HELO (as smtplib): the server's extensions."""
    try:
        await session.ehlo()
    except aiosmtplib.SMTPHeloError:
        await session.helo()


class Pool:
    """The sessions of one server on one event loop: at most `size` open (idle or in use) at any time."""

    def __init__(self, server: Server, size: int) -> None:
        self.server = server
        self.size = size
        self._slots = asyncio.Semaphore(size)
        #: Open sessions no message uses now, the most recently used last (the likeliest to be still up).
        self._idle: list[aiosmtplib.SMTP] = []
        self._closed = False
        self._context: ssl.SSLContext | None = None

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """The right to hold one session; a message waits here while `size` others hold theirs."""
        async with self._slots:
            yield

    def idle(self) -> aiosmtplib.SMTP | None:
        """An idle session to reuse (the server may have dropped it meanwhile), or None. Only within `slot()`."""
        return self._idle.pop() if self._idle else None

    async def connect(self) -> aiosmtplib.SMTP:
        """A new session. Only within `slot()`: a slot holder that found no idle session opens one, so at most
        `size` are ever open."""
        if self._context is None:  # reading the trust store takes milliseconds: not on the event loop, and once
            self._context = await asyncio.to_thread(ssl.create_default_context, cafile=self.server.ca_file)
        return await _open(self.server, self._context)

    def give_back(self, session: aiosmtplib.SMTP) -> None:
        """`session` is free for the next message, if it is still connected."""
        if session.is_connected and not self._closed:
            self._idle.append(session)
        else:
            session.close()

    @staticmethod
    def discard(session: aiosmtplib.SMTP) -> None:
        """Close `session` without a word: its state is unknown (a failure or a cancel midway)."""
        session.close()

    async def close(self) -> None:
        """QUIT every idle session, all at once and for QUIT_TIMEOUT_S at most; those in use close when given back."""
        self._closed = True
        idle, self._idle = self._idle, []
        await asyncio.gather(*(_quit(session) for session in idle))


async def _quit(session: aiosmtplib.SMTP) -> None:
    with contextlib.suppress(aiosmtplib.SMTPException, OSError):  # a server that does not answer is left all the same
        await session.quit(timeout=QUIT_TIMEOUT_S)
    session.close()


def pool(settings: Settings) -> Pool:
    """The running event loop's pool for the server `settings` name."""
    server = Server.of(settings)
    return aio.per_loop(server.key, lambda: Pool(server, settings.smtp_pool_size), Pool.close)
