"""Webhook delivery mechanics: request signing, and one POST to an address the SSRF guard vetted.

Signature (header `X-Pipeline-Signature: t=<unix seconds>,v1=<hex>`): HMAC-SHA256 with
WEBHOOK_SIGNING_SECRET over ``f"{t}.".encode() + body``; receivers recompute it, compare in constant
time and reject timestamps older than a few minutes (`verify`).

SSRF guard (`tasks.netguard.vet`, shared with media sources): the URL's host is resolved once; every
address must be public unless the host name or a network containing the address is in
WEBHOOK_ALLOWED_HOSTS. `post` then connects to the vetted address itself (the Host header and TLS server
name stay the original host), so a second DNS answer cannot point it elsewhere (DNS rebinding);
redirects are never followed.

Connections: one aiohttp session per event loop (a worker process of the asyncio pool has one), kept alive per
vetted address and reused by every delivery to it; at most WEBHOOK_MAX_CONNECTIONS open, and at most
WEBHOOK_CONNECTIONS_PER_HOST to one address (the rest wait their turn in the process). Not httpx's AsyncClient: its
connection pool walks every connection for each request (https://github.com/encode/httpcore/pull/1035, open), which
at a few hundred deliveries in flight cost most of a worker's CPU (docs/benchmarks.md, "I/O concurrency").
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time

import aiohttp
import yarl

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


#: A response body larger than this is not read: its connection is closed instead of kept for the next delivery.
MAX_BODY_READ = 1 << 20


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a delivery's classification needs of the subscriber's response."""

    status_code: int
    reason: str
    retry_after: str | None


class Pool:
    """This event loop's HTTP connections: one aiohttp session, kept alive per destination address, at most
    `max_connections` open and `per_host` to one address (aiohttp's connector limits)."""

    def __init__(self, max_connections: int, per_host: int) -> None:
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=per_host, use_dns_cache=False)
        self.session = aiohttp.ClientSession(
            connector=connector, trust_env=False, auto_decompress=False, headers={"User-Agent": USER_AGENT}
        )

    async def aclose(self) -> None:
        await self.session.close()


def pool(max_connections: int, per_host: int) -> Pool:
    """The running event loop's pool (made on first use; closed when the worker stops: `pipeline.pools.aio`)."""
    return aio.per_loop("webhooks.http", lambda: Pool(max_connections, per_host), Pool.aclose)


async def post(
    url: yarl.URL, target: Target, body: bytes, headers: dict[str, str], connect_s: float, timeout_s: float, via: Pool
) -> Answer:
    """POST `body` to `target.address`, presenting `url`'s host (Host header, TLS server name and certificate check),
    on a pooled connection to that address; redirects are not followed; transport failures are `TransientError`."""
    direct = url.with_host(target.address)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, connect=connect_s, sock_read=timeout_s)
    request_headers = {"Host": url.raw_authority, **headers}
    tls_name = target.host if url.scheme == "https" else None
    try:
        async with via.session.post(
            direct,
            data=body,
            headers=request_headers,
            allow_redirects=False,
            timeout=timeout,
            server_hostname=tls_name,
        ) as response:
            if (response.content_length or 0) <= MAX_BODY_READ:
                await response.read()  # the whole answer read: its connection goes back to the pool
            return Answer(response.status, response.reason or "", response.headers.get("Retry-After"))
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
        raise TransientError(f"{type(exc).__name__} posting to {target.host}: {exc}") from exc
