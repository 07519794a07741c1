"""Webhook delivery mechanics: request signing, and one POST to an address the SSRF guard vetted.

Signature (header `X-Pipeline-Signature: t=<unix seconds>,v1=<hex>`): HMAC-SHA256 with
WEBHOOK_SIGNING_SECRET over ``f"{t}.".encode() + body``; receivers recompute it, compare in constant
time and reject timestamps older than a few minutes (`verify`).

SSRF guard (`tasks.netguard.vet`, shared with media sources): the URL's host is resolved once; every
address must be public unless the host name or a network containing the address is in
WEBHOOK_ALLOWED_HOSTS. `post` then connects to the vetted address itself (the Host header and TLS server
name stay the original host), so a second DNS answer cannot point it elsewhere (DNS rebinding);
redirects are never followed.

Connections: one `httpx.AsyncClient` per event loop (a worker process of the asyncio pool has one), kept alive per
vetted address and reused by every delivery to it; at most WEBHOOK_MAX_CONNECTIONS open, and at most
WEBHOOK_CONNECTIONS_PER_HOST requests at once to one host (the rest wait their turn in the process).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

import httpx

from pipeline.errors import TransientError
from pipeline.pools import aio
from tasks.netguard import Target

SIGNATURE_HEADER = "X-Pipeline-Signature"
EVENT_HEADER = "X-Pipeline-Event"
IDEMPOTENCY_HEADER = "Idempotency-Key"
ATTEMPT_HEADER = "X-Pipeline-Attempt"
USER_AGENT = "pipeline-webhooks/1"


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: bytes, header: str, body: bytes, tolerance_s: float = 300, now: float | None = None) -> bool:
    """What a receiver does: True when `header` signs `body` with `secret` and is recent enough."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), f"t={timestamp},v1={parts.get('v1', '')}")


def _client(max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(follow_redirects=False, trust_env=False, limits=limits, headers={"User-Agent": USER_AGENT})


class Pool:
    """This event loop's HTTP client (keep-alive per destination address) and its per-host connection bounds."""

    def __init__(self, max_connections: int, per_host: int) -> None:
        self.client = _client(max_connections)
        self.per_host = per_host
        self.hosts: dict[str, asyncio.Semaphore] = {}

    def bound(self, host: str) -> asyncio.Semaphore:
        found = self.hosts.get(host)
        if found is None:
            found = self.hosts[host] = asyncio.Semaphore(self.per_host)
        return found

    async def aclose(self) -> None:
        await self.client.aclose()


def pool(max_connections: int, per_host: int) -> Pool:
    """The running event loop's pool (made on first use; closed when the worker stops: `pipeline.pools.aio`)."""
    return aio.per_loop("webhooks.http", lambda: Pool(max_connections, per_host), Pool.aclose)


async def post(
    url: httpx.URL,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    connect_s: float,
    timeout_s: float,
    connections: Pool,
) -> httpx.Response:
    """POST `body` to `target.address`, presenting `url`'s host, on a pooled connection to that address (at most
    `connections.per_host` at once per host); transport failures are `TransientError`."""
    direct = url.copy_with(host=target.address)
    timeout = httpx.Timeout(timeout_s, connect=connect_s)
    extensions = {"sni_hostname": target.host} if url.scheme == "https" else {}
    request_headers = {"Host": url.netloc.decode("ascii"), **headers}
    try:
        async with connections.bound(target.host):
            return await connections.client.post(
                direct, content=body, headers=request_headers, extensions=extensions, timeout=timeout
            )
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise TransientError(f"{type(exc).__name__} posting to {target.host}: {exc}") from exc
