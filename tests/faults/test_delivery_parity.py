"""The delivery layer's reaches into kombu and Celery, against upstream's own behaviour at test time.

`pipeline.delivery` replaces kombu's Redis fetch and parts of its QoS, and reads private attributes of Celery's
request and kombu's hub (`pipeline.delivery.ENTRIES`). Each test here runs upstream's own code on the same input as
the pipeline's and compares the outcomes, so an upgrade that changes what kombu writes or Celery keeps fails here:
the same messages delivered in the same order with the same `unacked` records as kombu's own transport, a requeued
message put back as kombu puts it back, the hub's loop thread, and the request attributes the delivery layer reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.consumer.consumer import Consumer as CeleryConsumer
from celery.worker.request import Request as CeleryRequest
from kombu import Connection, Consumer, Exchange, Message, Producer, Queue
from kombu.asynchronous import Hub, get_event_loop, set_event_loop
from redis import exceptions as redis_errors
from vine import promise

from pipeline.delivery import acks, broadcasts, transport
from pipeline.delivery.lease import Leases
from tests.support.procs import RedisServer

pytestmark = [pytest.mark.faults, pytest.mark.parity]

PRIORITIES = (0, 9, 5, 0, 3, 9, 6, 1)


def _queues(key: str) -> list[Queue]:
    return [Queue(f"{key}-{n}", Exchange(f"{key}-{n}", "direct"), f"{key}-{n}", max_priority=9) for n in (1, 2)]


def _consume_all(conn: Connection, queues: list[Queue], n: int, prefetch: int) -> list[Any]:
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, prefetch, False)
    with Consumer(channel, queues, callbacks=[lambda body, message: got.append(message)]):
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    return got


def _run(redis: RedisServer, transport_cls: Any, key: str) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Publish the same messages to two queues, consume them all (prefetch 4) with `transport_cls`: the bodies in the
    order each queue delivered them, and each delivered message's `unacked` record (keyed by its body)."""
    queues = _queues(key)
    with Connection(redis.url, transport=transport_cls) as conn:
        producer = Producer(conn.channel())
        for i, priority in enumerate(PRIORITIES):
            queue = queues[i % 2]
            producer.publish(
                {"n": i}, exchange=queue.exchange, routing_key=queue.routing_key, priority=priority, declare=[queue]
            )
        got = _consume_all(conn, queues, len(PRIORITIES), prefetch=len(PRIORITIES))
        client = redis.client()
        order: dict[str, list[Any]] = {}
        records: dict[str, Any] = {}
        for message in got:
            order.setdefault(message.delivery_info["routing_key"], []).append(message.payload["n"])
            record = json.loads(client.hget("unacked", message.delivery_tag))
            records[json.dumps(message.payload)] = record
            message.ack()
    return {k.rpartition("-")[2]: v for k, v in order.items()}, {
        body: [record[0], *(x.rpartition("-")[2] for x in record[1:])] for body, record in records.items()
    }


def test_the_fetch_delivers_and_records_what_kombu_does(own_redis: RedisServer) -> None:
    """Each queue's messages in kombu's order (priority steps, then first in first out), every one of them, and
    each `unacked` record what kombu's `QoS.append` writes: [the message, its exchange, its routing key]."""
    kombu_order, kombu_records = _run(own_redis, "redis", f"stock-{uuid.uuid4().hex[:6]}")
    own_redis.client().flushall()
    ours_order, ours_records = _run(own_redis, transport.bound(Leases()), f"ours-{uuid.uuid4().hex[:6]}")
    assert sum(len(v) for v in kombu_order.values()) == len(PRIORITIES)
    assert ours_order == kombu_order
    assert ours_records.keys() == kombu_records.keys()
    for body, record in kombu_records.items():
        ours = ours_records[body]
        # The delivery tag, exchange and routing key differ by the queue names' random part only.
        for side in (record, ours):
            side[0]["properties"]["delivery_tag"] = "tag"
            side[0]["properties"]["delivery_info"] = {
                k: str(v).rpartition("-")[2] for k, v in side[0]["properties"]["delivery_info"].items()
            }
        assert ours == record


def _requeued(redis: RedisServer, transport_cls: Any) -> Any:
    name = f"requeue-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, Exchange(name, "direct"), name)
    with Connection(redis.url, transport=transport_cls) as conn:
        Producer(conn.channel()).publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        (message,) = _consume_all(conn, [queue], 1, prefetch=1)
        message.requeue()
        client = redis.client()
        assert client.llen(name) == 1 and client.hlen("unacked") == 0
        element = json.loads(client.lindex(name, 0))
    element["properties"]["delivery_info"] = {
        k: str(v).replace(name, "q") for k, v in element["properties"]["delivery_info"].items()
    }
    element["properties"]["delivery_tag"] = "tag"
    return element


def test_a_requeued_delivery_is_back_as_kombu_puts_it_back(own_redis: RedisServer) -> None:
    """A delivery given back (`reject(requeue=True)`) is on its queue again, byte for byte what kombu's own restore
    (`Channel._do_restore_message`) writes, the `redelivered` mark included."""
    kombu_element = _requeued(own_redis, "redis")
    ours = _requeued(own_redis, transport.bound(Leases()))
    assert ours == kombu_element
    assert ours["headers"].get("redelivered") is True or ours["properties"].get("redelivered") is True


def test_kombus_close_reads_the_fetch_in_flight_first_and_marks_closing(own_redis: RedisServer) -> None:
    """kombu's `Channel.close` reads the reply of a fetch in flight (`_in_poll`) before anything else, with
    `_closing` already set, and lets only `Empty` through: the worker channel's `close` reads it first, letting a
    connection error through too (`pipeline.delivery.transport`), and no longer fetches once `_closing`."""
    from queue import Empty

    seen: list[bool] = []
    with Connection(own_redis.url) as conn:
        channel = conn.channel()

        def read(**_: Any) -> None:
            seen.append(channel._closing)
            raise Empty()

        channel._in_poll = True
        channel._brpop_read = read
        channel.close()
        assert seen == [True] and channel.closed
        broken = conn.channel()
        broken._in_poll = True
        broken._brpop_read = lambda **_: (_ for _ in ()).throw(redis_errors.ConnectionError("gone"))
        with pytest.raises(redis_errors.ConnectionError):
            broken.close()  # kombu's own: the channel is left open
        assert not broken.closed and broken._closing


def test_the_loop_thread_is_the_hubs() -> None:
    """An acknowledgement is deferred only on the thread that runs kombu's event loop (`Hub._loop_thread`)."""
    hub = Hub()
    previous = get_event_loop()
    set_event_loop(hub)
    seen: dict[str, Any] = {}

    def run_loop() -> None:
        loop = hub.create_loop()
        next(loop)  # the loop records its thread before its first poll
        seen["on the loop"] = acks.loop_hub()

    try:
        thread = threading.Thread(target=run_loop)
        thread.start()
        thread.join(10)
        seen["elsewhere"] = acks.loop_hub()
    finally:
        set_event_loop(previous)
        hub.close()
    assert seen == {"on the loop": hub, "elsewhere": None}


def test_celerys_scheduled_acknowledgement_is_what_land_runs_at_a_shutdown() -> None:
    """Celery schedules a job's acknowledgement on the hub for the loop's next iteration (`Consumer.call_soon_ack`: a
    promise of the message's `ack_log_error` in `Hub._ready`): `acks.land` runs it now, and leaves the hub's other
    callbacks for the loop."""
    hub = Hub()
    acked: list[str] = []
    channel = SimpleNamespace(no_ack_consumers=None, basic_ack=lambda tag, multiple=False: acked.append(tag))
    message = Message(body=b"{}", delivery_tag="tag-1", channel=channel)
    on_ack = promise(CeleryConsumer.call_soon_ack, (SimpleNamespace(hub=hub), message.ack_log_error))
    try:
        on_ack(logging.getLogger(__name__), ())  # what `Request.acknowledge` calls
        hub.call_soon(lambda: None)
        assert not acked and len(hub._ready) == 2
        acks.land(hub)
        assert acked == ["tag-1"] and message.acknowledged
        assert len(hub._ready) == 1  # the other callback waits for the loop
    finally:
        hub.close()


def test_celerys_request_has_what_the_delivery_layer_reads() -> None:
    """Celery's own request, built from a task message, keeps what `pipeline.delivery.request` and `fencing` read
    and call: the message, its body and content type, the eventer, the context, the cancel mark, the pool's result
    and the methods it overrides."""
    app = Celery("parity", set_as_current=False)

    @app.task(name="parity.noop", shared=False)
    def noop() -> None:
        """A task for the request to name."""

    message = TaskMessage("parity.noop", id=uuid.uuid4().hex)
    eventer = object()
    request = CeleryRequest(message, app=app, task=noop, eventer=eventer)
    assert request._message is message
    assert request._eventer is eventer
    assert request._body == message.body
    assert request._content_type == message.content_type
    assert request._content_encoding == message.content_encoding
    assert request._context.id == request.id
    assert request._already_cancelled is False
    assert request._apply_result is None
    assert request._terminate_on_ack is None
    for method in ("_announce_revoked", "_announce_cancelled", "revoked", "cancel", "on_failure", "send_event"):
        assert callable(getattr(request, method)), method


def test_billiards_result_is_accepted_and_terminated_as_fencing_drives_it() -> None:
    """`fencing._unqueue` takes a job out of the prefork pool's outbound buffer and settles its billiard result as
    the pool would have: accepted (`ApplyResult._ack`, which calls the request's accept callback) and terminated
    (`_set_terminated`, which calls its error callback with `Terminated`); the asynchronous pool keeps that buffer."""
    from billiard.exceptions import Terminated
    from billiard.pool import ApplyResult
    from celery.concurrency.asynpool import AsynPool

    accepted: list[int] = []
    errors: list[Any] = []
    cache: dict[Any, Any] = {}
    result = ApplyResult(
        cache, None, accept_callback=lambda pid, at: accepted.append(pid), error_callback=errors.append
    )
    result._ack(None, time.time(), 4242, None)
    result._set_terminated(9)
    assert accepted == [4242] and result.ready() and not result.successful()
    assert len(errors) == 1 and errors[0].type is Terminated
    assert "outbound_buffer" in AsynPool.__init__.__code__.co_names  # the attribute `_unqueue` reads


def test_kombus_poller_registers_and_reads_a_watch_as_the_watches_drive_it(own_redis: RedisServer) -> None:
    """What `pipeline.delivery.watches` reaches in kombu's own transport: a connection from the channel's
    `async_pool` registered with the poller (`_register`: `_fd_to_chan` maps its socket to the channel and type),
    read through `on_readable` by the channel's `handlers[type]`; `_chan_to_sock` keyed by (channel, client, type)."""
    from pipeline.delivery.watches import Watch

    with Connection(own_redis.url) as conn:
        channel: Any = conn.channel()
        cycle = conn.transport.cycle
        pool = channel.async_pool
        watch = Watch(pool.connection_class(**pool.connection_kwargs))
        answers: list[Any] = []
        channel.handlers["WATCH:k"] = lambda: answers.append(watch.connection.read_response())
        watch.connection.send_command("BLMOVE", "k", "k", "RIGHT", "RIGHT", "5")
        cycle._register(channel, watch, "WATCH:k")
        fd = watch.connection._sock.fileno()
        assert cycle._fd_to_chan[fd] == (channel, "WATCH:k")
        own_redis.client().lpush("k", "x")
        time.sleep(0.2)
        cycle.on_readable(fd)  # kombu's: the channel can consume, so its handler reads the reply
        assert answers == [b"x"] and own_redis.client().lrange("k", 0, -1) == [b"x"]  # BLMOVE k k: nothing taken
        assert cycle._chan_to_sock[(channel, watch, "WATCH:k")] is watch.connection._sock
        watch.connection.disconnect()


@pytest.mark.parametrize("prefix", [True, "/custom.", False], ids=["default", "named", "none"])
def test_celerys_revoke_broadcast_is_read_on_the_topic_kombu_publishes_it(
    own_redis: RedisServer, prefix: bool | str
) -> None:
    """Celery's control broadcasts, published by kombu's Redis transport on database 3 with this `fanout_prefix`, are
    heard on `broadcasts.topic`; `broadcasts.terminated_ids` reads the ids of each revoke with terminate meant for
    the node (every node, its name, a pattern matching it) and nothing of the others."""
    options = {"fanout_prefix": prefix}
    app = Celery("parity", broker=own_redis.url.rsplit("/", 1)[0] + "/3", set_as_current=False)
    app.conf.broker_transport_options = options
    pubsub = own_redis.client().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(broadcasts.topic(3, app.control.mailbox.exchange.name, options))
    try:
        app.control.revoke("a", terminate=True)
        app.control.revoke(["b", "c"], terminate=True, signal="SIGKILL", destination=["w1@h"])
        app.control.terminate("d", signal="KILL")
        app.control.broadcast("revoke", arguments={"task_id": "e", "terminate": True}, pattern="w1@*", matcher="glob")
        app.control.revoke("f")  # no terminate: Celery's own handler's alone
        app.control.revoke("g", terminate=True, destination=["w2@h"])
        app.control.broadcast("rate_limit", arguments={"task_name": "x", "rate_limit": "1/s"})
        heard: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(heard) < 7 and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
            if message and message["type"] == "message":
                heard.append(message["data"])
    finally:
        pubsub.close()
        app.close()
    assert [broadcasts.terminated_ids(data, "w1@h") for data in heard] == [["a"], ["b", "c"], ["d"], ["e"], [], [], []]
    assert broadcasts.terminated_ids(heard[0], "w2@h") == ["a"] and broadcasts.terminated_ids(heard[1], "w2@h") == []
