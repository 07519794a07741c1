"""Flower's broker view (queue lengths) on a Redis Cluster URL.

Flower 2.2 builds its broker view's client in `flower.views.BaseHandler.get_broker`: `flower.utils.broker.Broker`,
which picks a class by the broker URL's scheme and has none for the cluster transport (the *Broker* page and
`/api/queues/length` answer 404). On a cluster URL `install` replaces that method with one giving `ClusterBroker`,
whose `queues(names)` answers as flower's `RedisBase.queues` does (`[{"name": ..., "messages": ...}]`, a queue's
messages the sum of its priority levels), read from each queue's cluster lists (`pipeline.queues.keys`, one slot per
queue) through an asyncio cluster client of every seed (`pipeline.cluster`). Elsewhere Flower's own client runs.

Left off (Flower's own path, one WARNING) on a flower this was not verified on (`pipeline.compat.enabled`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeline import cluster
from pipeline.queues import keys

#: Longest wait for one node (connect or answer), as flower's own Redis client (`RedisBase.DEFAULT_SOCKET_TIMEOUT`).
TIMEOUT_S = 2.0


class ClusterBroker:
    """Flower's broker client contract (`queues`) on the broker's Redis Cluster."""

    async def queues(self, names: Iterable[str]) -> list[dict[str, Any]]:
        levels = {name: keys.levels(name, True) for name in names}
        client = cluster.async_client(TIMEOUT_S, max_connections=4)
        try:
            pipe = client.pipeline()
            for queue_levels in levels.values():
                for level in queue_levels:
                    pipe.llen(level)
            lengths = iter(await pipe.execute())
            return [{"name": name, "messages": sum(next(lengths) for _ in each)} for name, each in levels.items()]
        finally:
            await client.aclose()


def get_broker(handler: Any) -> ClusterBroker:
    """What `BaseHandler.get_broker` gives on a cluster URL."""
    return ClusterBroker()


def install() -> bool:
    """Give Flower's handlers `ClusterBroker` (a process that runs Flower on a cluster URL); False when left off."""
    from pipeline.compat import enabled

    if not enabled(__name__):
        return False
    from flower.views import BaseHandler

    BaseHandler.get_broker = get_broker
    return True
