"""The worker's broker connection: kombu's `Connection`, keeping the delivery layer's transport across a failover.

A worker consumes through a transport bound to its `Leases` (`pipeline.delivery.transport.bound`: a class path in
`broker_transport`). kombu 5.7's `Connection.switch` (`kombu/connection.py`), which `maybe_switch_next` calls when a
connection attempt fails and the broker URL lists several `;`-separated URLs, re-parses the next URL and sets
`transport_cls` to that URL's scheme: after one failed attempt during a Sentinel failover the worker went on with
kombu's stock `sentinel` (or `redis`) transport, with no lease, no delivery count and no fencing, and said so only
as `Connected to sentinel://...` in its log.

`Connection` keeps the transport it was given when that is the delivery layer's: after kombu's own `switch` (the
close, the new host, port and credentials) it puts the bound transport back, before anything builds a transport
from the class. Every URL in the list must then be one that transport serves (`sentinel://` for the Sentinel class,
`redis://` and `rediss://` for the plain one), checked when the connection is made. It also retries sooner than
kombu (`ensure_connection`: a pause of `RETRY_START_S` after each round of the URLs, growing up to `RETRY_MAX_S`),
so a worker is back within a second of the new primary.

`install` makes it the class Celery builds every broker connection of the app with (`app.amqp.Connection`, Celery's
extension point), so the consumer, its pidbox and the worker's producers share it; a clone (`Connection.clone`)
keeps the class and the transport. Producers, beat and Flower keep kombu's own class.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kombu import Connection as KombuConnection
from kombu.transport import resolve_transport

from pipeline.delivery import transport as delivery_transport

#: Pauses between rounds of connection attempts over the broker URLs (seconds): the first, and the longest.
RETRY_START_S = 0.5
RETRY_MAX_S = 1.0
#: The URL schemes each class of the delivery layer's transport serves.
SCHEMES: dict[type[Any], frozenset[str]] = {
    delivery_transport.SentinelTransport: frozenset({"sentinel"}),
    delivery_transport.Transport: frozenset({"redis", "rediss"}),
}


def delivery_class(transport: Any) -> type[Any] | None:
    """The delivery layer's transport class `transport` names (a class or a class path), or None if it is another."""
    try:
        cls = resolve_transport(transport) if isinstance(transport, str) else transport
    except (KeyError, ImportError, AttributeError, ValueError):
        return None  # not a transport kombu knows: its own error comes when the connection is used
    return cls if isinstance(cls, type) and issubclass(cls, tuple(SCHEMES)) else None


def _urls(hostname: Any, alternates: Any) -> list[str]:
    urls = hostname.split(";") if isinstance(hostname, str) else list(hostname or ())
    return [url for url in [*urls, *(alternates or ())] if isinstance(url, str) and "://" in url]


class Connection(KombuConnection):
    """kombu's `Connection` whose `switch` to another URL keeps the delivery layer's transport."""

    def __init__(self, hostname: Any = "localhost", *args: Any, **kwargs: Any) -> None:
        bound = delivery_class(kwargs.get("transport"))
        if bound is not None:
            served = next(schemes for base, schemes in SCHEMES.items() if issubclass(bound, base))
            stray = [url for url in _urls(hostname, kwargs.get("alternates")) if urlsplit(url).scheme not in served]
            if stray:
                raise ValueError(
                    f"the broker URLs mix schemes: {', '.join(sorted({urlsplit(u).scheme for u in stray}))} beside "
                    f"{', '.join(sorted(served))}; the worker's transport serves one kind"
                )
        super().__init__(hostname, *args, **kwargs)
        #: The delivery layer's transport this connection was made with (kept across `switch`), else None.
        self.kept_transport: Any = kwargs.get("transport") if bound is not None else None

    def ensure_connection(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's, retrying sooner when not told otherwise: the first pause after a round of every URL is
        `RETRY_START_S`, growing by as much up to `RETRY_MAX_S` (kombu's defaults, 2 s growing by 2 s up to 30 s,
        put a worker back 6 s after a Sentinel failover that took 2 s)."""
        kwargs.setdefault("interval_start", RETRY_START_S)
        kwargs.setdefault("interval_step", RETRY_START_S)
        kwargs.setdefault("interval_max", RETRY_MAX_S)
        return super().ensure_connection(*args, **kwargs)

    def switch(self, conn_str: str) -> None:
        """kombu's switch to `conn_str` (it closes this connection and resets the transport to the URL's scheme),
        then the delivery layer's transport put back."""
        super().switch(conn_str)
        if self.kept_transport is not None:
            self.transport_cls = self.kept_transport


def install(app: Any) -> None:
    """Make `Connection` the class every broker connection of `app` is built with (a worker's, once its transport
    is bound)."""
    app.amqp.Connection = Connection
