"""Request-body limits, enforced before any body is parsed: size (413) and time (408).

A declared Content-Length above API_MAX_BODY_BYTES is refused without reading the body; a body sent
without one (chunked) is read up to the limit and refused as soon as it passes it. The whole body must
arrive within API_BODY_TIMEOUT seconds of the first read: a client that declares more than it sends (or
trickles it) gets a 408 and the connection is closed, instead of holding a server slot open. The accepted
body is then handed to the application unchanged.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """Pure ASGI middleware: 413 for bodies over `max_bytes`, 408 for bodies not in within `timeout_s`."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _refuse(send, 400, "invalid Content-Length")
                return
            if declared > self.max_bytes:
                await _refuse(send, 413, f"request body is {declared} bytes; the limit is {self.max_bytes}")
                return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await _refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s")
            return
        except _TooLarge:
            await _refuse(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body (None if the client disconnected); `_TooLarge` as soon as it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


async def _refuse(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
