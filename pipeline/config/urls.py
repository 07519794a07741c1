"""Which broker and result backend URLs the pipeline accepts: `redis://`, `rediss://`, `sentinel://` (one or more,
`;`-separated) and a Redis Cluster's `redis+cluster://` / `rediss+cluster://` (`pipeline.config.cluster`).

`check_redis_url` refuses any other at start, naming the variable; it connects to nothing.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pipeline.config import cluster


def check_redis_url(name: str, url: str, sentinel_master: str | None) -> None:
    """Refuse a URL the Redis transport cannot use, naming the variable (a cluster's: `pipeline.config.cluster`)."""
    scheme = urlsplit(url.split(";")[0]).scheme
    if scheme in cluster.SCHEMES:
        cluster.parse(url, name)
    elif scheme not in ("redis", "rediss", "sentinel"):
        raise ValueError(
            f"{name} must start with redis://, rediss://, sentinel:// or redis+cluster:// (got {scheme or url!r})"
        )
    if scheme == "sentinel" and not sentinel_master:
        raise ValueError(f"{name} is a sentinel:// URL: set REDIS_SENTINEL_MASTER to the monitored master's name")
    if scheme in ("redis", "rediss") and not urlsplit(url).hostname and "socket" not in url:
        raise ValueError(f"{name} has no host: {url!r}")
