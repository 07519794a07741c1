"""The cluster transport on kombu's hub, driven in a process of its own (its settings are the cluster's):
`python -m tests.support.cluster_producer loop <queue> -` prints what `main` saw (JSON).

A worker's transport (bound to leases) consumes `<queue>` and a queue bound to a fanout exchange, registered with a
real `kombu.asynchronous.Hub`, whose loop runs here as Celery's asynchronous loop runs it. The fallback poll is 30 s,
so what arrives sooner came through a wake-up: the idle queue's waiter armed; the subscription's socket among the
hub's readers, and a fanout publish delivered; a job pushed (with its marker) delivered and acknowledged, and how long
after its push.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub, set_event_loop

from pipeline.config import get_settings
from pipeline.config.celery import CLUSTER_TRANSPORT, cluster_broker
from pipeline.delivery import clustered, waking
from pipeline.delivery.cluster_loop import pubsub_fileno
from pipeline.delivery.lease import Leases

FANOUT = Exchange("probe.fanout", type="fanout")


def _spin(loop: Iterator[Any], until: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        next(loop)
    return until()


def main(queue: str) -> dict[str, Any]:
    waking.Waking.wake_poll_s = 30.0
    url = cluster_broker(get_settings())["broker_url"]
    hub = Hub()
    set_event_loop(hub)
    conn = Connection(url, transport=clustered.bound(Leases(6, "probe@host", cluster=True)))
    conn.connect()
    conn.transport.register_with_event_loop(conn.connection, hub)
    channel: Any = conn.channel()
    got: list[tuple[str, Any, float]] = []

    def on_work(body: Any, message: Any) -> None:
        got.append(("work", body, time.time()))
        message.ack()

    work = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
    Consumer(channel, [work], callbacks=[on_work], accept=["json"]).consume()
    bcast = Queue("probe.bcast", FANOUT)
    Consumer(channel, [bcast], no_ack=True, callbacks=[lambda body, _m: got.append(("fanout", body, 0.0))]).consume()
    loop = hub.create_loop()
    seen: dict[str, Any] = {"armed": _spin(loop, lambda: queue in channel.waiters.armed(), 10)}
    fd = pubsub_fileno(channel._pubsub)
    seen["subscription_polled"] = fd is not None and fd in hub.readers
    sender = Connection(url, transport=CLUSTER_TRANSPORT)
    producer = Producer(sender.channel())
    producer.publish({"n": 1}, exchange=FANOUT, routing_key="", serializer="json", declare=[FANOUT])
    seen["fanout"] = _spin(loop, lambda: any(kind == "fanout" for kind, _b, _t in got), 10)
    time.sleep(0.5)  # the waiter blocks on the queue's marker by now
    pushed = time.time()
    producer.publish({"n": 2}, exchange=work.exchange, routing_key=queue, serializer="json")
    seen["work"] = _spin(loop, lambda: any(kind == "work" for kind, _b, _t in got), 20)
    seen["latency"] = next((t - pushed for kind, _b, t in got if kind == "work"), None)
    seen["held"] = len(channel.qos._delivered) - len(channel.qos._dirty)  # kombu's: acknowledged, not yet flushed
    sender.release()
    conn.release()
    hub.close()
    return seen
