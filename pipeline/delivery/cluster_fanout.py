"""Celery's fanout on a Redis Cluster (control broadcasts, events), mixed into the cluster transport's channel
(`pipeline.delivery.clustered`) ahead of kombu's virtual channel.

A fanout exchange is a pub/sub channel, kombu's name for it (`/0.<exchange>`): a PUBLISH on any node of a cluster
reaches the subscribers of every node (redis.io/commands/publish), so one subscription on one node serves it. The
channel delivers what came at the start of each round of its fetch, and, on the worker's event loop, whenever the
subscription's socket is readable (`pipeline.delivery.cluster_loop`).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kombu.utils.encoding import bytes_to_str

#: kombu's prefix of a fanout exchange's pub/sub channel (database 0: the only one of a cluster).
FANOUT_PREFIX = "/0."


class Fanout:
    supports_fanout = True
    client: Any
    connection: Any
    typeof: Any
    _pubsub: Any = None

    def _fanout_state(self) -> tuple[dict[str, str], dict[str, str]]:
        """(bound queue -> fanout exchange, subscribed channel name -> consumed queue), made on first use."""
        if not hasattr(self, "_fanout"):
            self._fanout: dict[str, str] = {}
            self._subscribed: dict[str, str] = {}
        return self._fanout, self._subscribed

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        consumer = super().basic_consume(queue, no_ack, *args, **kwargs)  # type: ignore[misc]  # the channel's
        bound, subscribed = self._fanout_state()
        if queue in bound:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub()
            name = FANOUT_PREFIX + bound[queue]
            self._pubsub.subscribe(name)
            subscribed[name] = queue
        return consumer

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        if self.typeof(exchange).type == "fanout":
            self._fanout_state()[0][queue] = exchange

    def _put_fanout(self, exchange: str, message: Any, routing_key: str, **kwargs: Any) -> None:
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:  # a recorded publish (`pipeline.compat.batch`): its command, not sent
            batch.add("publish", FANOUT_PREFIX + exchange, json.dumps(message))
            return
        self.client.publish(FANOUT_PREFIX + exchange, json.dumps(message))

    def _broadcasts(self) -> int:
        """Deliver what came on the subscribed fanout exchanges; how many."""
        got = 0
        while self._pubsub is not None:
            # Every reply read, a subscription's confirmation too: the hub polls the socket, and a message read into
            # redis-py's buffer behind a confirmation would wait there for the next one.
            reply = self._pubsub.get_message(timeout=0.0)
            if reply is None:
                return got
            if reply.get("type") != "message":
                continue
            queue = self._fanout_state()[1].get(bytes_to_str(reply["channel"]))
            if queue is not None:
                self.connection._deliver(json.loads(bytes_to_str(reply["data"])), queue)
                got += 1
        return got

    def unsubscribe(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None
