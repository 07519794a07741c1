"""Webhook delivery mechanics: request signing, the SSRF guard, and one POST to a vetted address.

Signature (header `X-Pipeline-Signature: t=<unix seconds>,v1=<hex>`): HMAC-SHA256 with
WEBHOOK_SIGNING_SECRET over ``f"{t}.".encode() + body``; receivers recompute it, compare in constant
time and reject timestamps older than a few minutes (`verify`).

SSRF guard (`vet`): the URL's host is resolved once; every address must be public (not loopback,
private, link-local, multicast, reserved, unspecified, shared or cloud metadata) unless the host name
or the address is in WEBHOOK_ALLOWED_HOSTS. The request then connects to the vetted address itself
(the Host header and TLS server name stay the original host), so a second DNS answer cannot point it
elsewhere (DNS rebinding); redirects are never followed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import time
from dataclasses import dataclass

import httpx

from pipeline.errors import PermanentError, TransientError

SIGNATURE_HEADER = "X-Pipeline-Signature"
EVENT_HEADER = "X-Pipeline-Event"
IDEMPOTENCY_HEADER = "Idempotency-Key"
ATTEMPT_HEADER = "X-Pipeline-Attempt"
USER_AGENT = "pipeline-webhooks/1"

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


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


class AddressRefused(PermanentError):
    """The destination resolves to an address webhooks may not reach."""


@dataclass(frozen=True)
class Target:
    host: str
    address: str
    port: int


def _is_public(ip: IP) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback)


def _allowed(host: str, ip: IP, allowlist: list[str]) -> bool:
    for entry in allowlist:
        if entry.lower() == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def vet(url: httpx.URL, allowlist: list[str]) -> Target:
    """Resolve `url`'s host and return an address it may use; `AddressRefused` when none may be used."""
    if url.scheme not in ("http", "https") or not url.host:
        raise PermanentError(f"webhook URL must be http(s) with a host: {url}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransientError(f"cannot resolve {url.host}: {exc}") from exc
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    refused = [ip for ip in addresses if not _is_public(ip) and not _allowed(url.host, ip, allowlist)]
    if refused or not addresses:
        raise AddressRefused(
            f"{url.host} resolves to {', '.join(map(str, refused or addresses))}: not a public address "
            "(allow it in WEBHOOK_ALLOWED_HOSTS)"
        )
    return Target(url.host, str(addresses[0]), port)


def post(
    url: httpx.URL, target: Target, body: bytes, headers: dict[str, str], connect_s: float, timeout_s: float
) -> httpx.Response:
    """POST `body` to `target.address`, presenting `url`'s host; transport failures are `TransientError`."""
    direct = url.copy_with(host=target.address)
    timeout = httpx.Timeout(timeout_s, connect=connect_s)
    extensions = {"sni_hostname": target.host} if url.scheme == "https" else {}
    request_headers = {"Host": url.netloc.decode("ascii"), "User-Agent": USER_AGENT, **headers}
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            return client.post(direct, content=body, headers=request_headers, extensions=extensions)
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise TransientError(f"{type(exc).__name__} posting to {target.host}: {exc}") from exc
