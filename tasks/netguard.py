"""The SSRF guard of every outbound URL a task fetches or posts to (webhooks, media sources).

`vet(url, allowlist)` resolves the URL's host once and returns the address to connect to. Every address
the name resolves to must be public: loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7),
link-local (169.254/16 with the cloud metadata address, fe80::/10), shared (100.64/10), multicast,
reserved and unspecified addresses are refused (`AddressRefused`, permanent), as are IPv6 forms that
carry such an IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`),
unless the host name or a network containing the address is in the caller's allowlist (`allow_all`
lifts the address rule altogether). One refused address refuses the URL, so a name cannot hide an
internal address behind a public one.

Name resolution failures, the same rule for every task:

* the name does not exist (NXDOMAIN: `EAI_NONAME`) or has no address (`EAI_NODATA`): `PermanentError`.
  The answer is authoritative; retrying a misspelt host for hours only delays the dead letter (a
  replay from the dead-letter queue retries it once the record exists);
* anything else (`EAI_AGAIN`: no answer from the name servers, `EAI_FAIL`: a server failure, ...):
  `TransientError`, retried with backoff.

`local_refusal(host)` is the check without network access that producers run at enqueue: the name
`localhost` (and `*.localhost`) and address literals that `vet` would refuse.

Callers that can connect to `Target.address` themselves (webhooks) are safe from DNS rebinding; a
caller that hands the URL to another program (ffmpeg resolves the name again) is not.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pipeline.errors import PermanentError, TransientError

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

#: getaddrinfo errors that mean the name has no address: the DNS answered, and the answer is "no".
_NO_SUCH_NAME = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if isinstance(code, int)
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class AddressRefused(PermanentError):
    """The destination resolves to an address the task may not reach."""


@dataclass(frozen=True)
class Target:
    """A vetted destination: connect to `address`:`port`, presenting `host`."""

    host: str
    address: str
    port: int


def embedded_ipv4(ip: IP) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, NAT64 or 6to4), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def is_public(ip: IP) -> bool:
    """True for a globally reachable unicast address; an IPv6 address carrying an IPv4 one is judged by it."""
    inner = embedded_ipv4(ip)
    if inner is not None:
        return is_public(inner)  # the IPv6 form only carries the IPv4 destination
    return ip.is_global and not (
        ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback or ip.is_unspecified
    )


def allowed(host: str, ip: IP, allowlist: Sequence[str]) -> bool:
    """True when `host` (exact name, any case) or a network containing `ip` is in `allowlist`."""
    for entry in allowlist:
        if entry.lower() == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


@functools.lru_cache(maxsize=1024)  # a worker delivers to the same few hosts again and again; a name raises, uncached
def _address(text: str) -> IP:
    return ipaddress.ip_address(text.split("%")[0])  # an IPv6 zone (`fe80::1%eth0`) is not part of it


def needs_lookup(host: str) -> bool:
    """Whether `vet` asks DNS for `host`: a name does, an address literal does not."""
    try:
        _address(host.strip("[]"))
    except ValueError:
        return True
    return False


def local_refusal(host: str, allowlist: Sequence[str] = ()) -> str | None:
    """Why `host` is refused without resolving it (`localhost`, a non-public literal), or None."""
    name = host.strip("[]").lower().rstrip(".")
    if name in (h.lower() for h in allowlist):
        return None
    if name == "localhost" or name.endswith(".localhost"):
        return f"{host} is localhost"
    try:
        ip = _address(name)
    except ValueError:
        return None  # a name: `vet` resolves it
    if is_public(ip) or allowed(name, ip, allowlist):
        return None
    return f"{host} is not a public address (a private, loopback, link-local or reserved address)"


def resolve(host: str, port: int) -> list[IP]:
    """Every address of `host` (an address literal is its own, unresolved); DNS failures are classified as the module
    docstring says."""
    with contextlib.suppress(ValueError):
        return [_address(host.strip("[]"))]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            raise PermanentError(f"cannot resolve {host}: no such name ({exc})") from exc
        raise TransientError(f"cannot resolve {host} for now: {exc}") from exc
    except UnicodeError as exc:  # a label IDNA cannot encode
        raise PermanentError(f"{host} is not a valid host name: {exc}") from exc
    return list(dict.fromkeys(_address(str(info[4][0])) for info in infos))


def vet(url: str, allowlist: Sequence[str] = (), *, allow_all: bool = False, setting: str = "") -> Target:
    """Resolve `url`'s host and return the address to use; `AddressRefused` when the rules forbid it.

    `setting` names the option that would allow the address, for the error message. With `allow_all`
    the name is still resolved (the same DNS failure rule applies) but any address is accepted.
    """
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise PermanentError(f"bad URL {url!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not host:
        raise PermanentError(f"the URL must be http(s) with a host: {url}")
    addresses = resolve(host, port)
    if not addresses:
        raise AddressRefused(f"{host} resolves to no address")
    if not allow_all:
        refused = [ip for ip in addresses if not is_public(ip) and not allowed(host, ip, allowlist)]
        if refused:
            hint = f" (see {setting})" if setting else ""
            raise AddressRefused(
                f"{host} resolves to {', '.join(map(str, refused))}: not a public address, "
                f"refusing a private address{hint}"
            )
    return Target(host, str(addresses[0]), port)
