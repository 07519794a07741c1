"""Redis Cluster URLs: `redis+cluster://[user:password@]host:port[,host:port...]/0` (`rediss+cluster://` for TLS).

The hosts are seed nodes: a client asks any of them for the cluster's slot map and follows it from then on (MOVED,
ASK, a new map after a failover or a resharding), so the seeds need not be the masters, nor all the nodes. A
cluster has one database, 0: any other is refused, as is a URL without a seed or with a port that is not one.
Credentials, when given, are the same on every node (as Redis Cluster requires of its clients).

`parse` checks a URL and gives its parts; `is_cluster` says whether a URL names a cluster at all. Neither connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

#: The schemes of a cluster URL: plain and TLS.
SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class ClusterUrl:
    """A checked cluster URL."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = None


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_cluster(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://` or `rediss+cluster://`)."""
    return scheme(url) in SCHEMES


def parse(url: str, name: str = "REDIS_URL") -> ClusterUrl:
    """The seeds, TLS and credentials of cluster URL `url`; ValueError naming `name` and the fault when it is not
    one a cluster client can use."""
    if not is_cluster(url):
        raise ValueError(f"{name} is not a Redis Cluster URL (redis+cluster:// or rediss+cluster://)")
    rest = url.split("://", 1)[1]
    if "?" in rest or "#" in rest:
        raise ValueError(f"{name}: a Redis Cluster URL takes no query or fragment: host:port[,host:port...]/0")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"{name}: a Redis Cluster has only database 0 (got /{path})")
    userinfo, _, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo)
    seeds = tuple(_seed(part, name) for part in hosts.split(",") if part.strip())
    if not seeds:
        raise ValueError(f"{name}: a Redis Cluster URL needs at least one seed node: {scheme(url)}://host:port/0")
    return ClusterUrl(seeds, scheme(url) == "rediss+cluster", username, password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _seed(part: str, name: str) -> tuple[str, int]:
    """`host:port`, `host` (port 6379) or `[v6 address]:port`."""
    part = part.strip()
    if part.startswith("["):
        host, _, tail = part[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
    if not host or any(c in host for c in " /@"):
        raise ValueError(f"{name}: {part!r} is not a seed node (host:port)")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{name}: seed {part!r} has no valid port")
    return host, int(port_text)


def seed_url(url: str) -> str:
    """A plain `redis://` (`rediss://`) URL of cluster URL `url`'s first seed node, with its credentials: what Celery's
    and kombu's own objects are built on, since neither parses a cluster URL. The pipeline writes through cluster
    clients (`pipeline.cluster`); a command Celery sends to this node for a key of a slot it does not serve is refused
    (MOVED), never misplaced."""
    parsed = parse(url)
    host, port = parsed.seeds[0]
    auth = ""
    if parsed.username is not None or parsed.password is not None:
        auth = f"{quote(parsed.username or '', safe='')}:{quote(parsed.password or '', safe='')}@"
    address = f"[{host}]" if ":" in host else host  # an IPv6 address in brackets
    return f"{'rediss' if parsed.tls else 'redis'}://{auth}{address}:{port}/0"
