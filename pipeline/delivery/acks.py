"""Acknowledgements made on the worker's event loop, written together: carried by the next fetch, or at the next tick.

A job's acknowledgement (late, after the job) is one fenced Lua call (`settle.lua`) and, made
synchronously, one blocking round trip of the worker's main process per job. `DeferredAcks` (mixed into the
transport's QoS) instead frees kombu's prefetch slot at once and keeps the tag:

- while the channel fetches (a fetch is in flight, or kombu's `on_poll_start`, a tick callback, is about to send
  one), the next fetch script acknowledges them first, in the same call (`fetch.lua`): no
  round trip of their own. A fetch in flight is answered within a fraction of a millisecond, and its reply wakes
  the loop, which sends the next fetch at once;
- otherwise (the channel waits on an empty queue, or the prefetch is full) `flush_acks`, a tick callback of
  kombu's hub, writes them all with one `settle.lua` call before the loop polls again.

A solo worker also hands each job's SUCCESS to the same call (`carry`, installed as the result backend's
`carrier` by `enable_carried_results`): the script stores the result, then acknowledges the job, so a
short job costs one round trip less, and its result and acknowledgement land together or not at all. A
result that would be stored by a chord part, or outside a delivery on the event loop's thread (any other
pool), is stored at once, as before.

A flow's fan-out item hands its node the same way (`carry_node`, installed in `pipeline.flows.record.CARRIERS`): the
next fetch records it (`fetch.lua`, as `flow_advance.lua` would), so an item costs no round trip of its own either.
Its job's acknowledgement is held back until the answer came: `Carried.answered` then queues what the item's
complete step lets run (the join), and only then is the acknowledgement deferred again, for the fetch after. A node
whose call got no answer (Redis restarted, the connection dropped) is recorded by a call of its own, which waits
for Redis as a prefork item's advance does (`Carried.record_now`: a node the lost call did record stays as it is), so
a finished item is not run again. Only a node that still cannot be recorded, or whose `answered` raised, leaves its
job unacknowledged and its lease given up (`Leases.drop`): the job is delivered again, and finds its node recorded
(nothing is run again) or runs again. At a tick with no fetch coming, the nodes are recorded by calls of their own
first (`Carried.record_now`).

Celery makes every acknowledgement in the event loop's next iteration (`Consumer.call_soon_ack`). A prefork
worker's reach Redis a loop iteration or two after the job's end; a solo worker runs each job inside the
delivery (`pipeline.delivery.fetch.deliver`), so the acknowledgements of a fetched batch, and its results, are
written after the batch's last job. A worker killed in that window runs those jobs again after their lease (none
of their results was stored), as a worker killed just before a synchronous acknowledgement would. The delivery stays
leased (held and renewed) until then. Acknowledgements made off the loop thread (no hub, or a pool thread) stay
synchronous. One that cannot reach Redis is remembered (`Leases.remember_ack`) and applied, fenced, by the
renewal thread; so is one a fetch carried when its reply was lost (it may have been applied: a second fenced
acknowledgement of a removed delivery removes nothing, and is logged as applied already while its lease was surely
still this worker's, as fenced otherwise).

A deferred acknowledgement is `Leases.settling` from the moment it is deferred, whatever becomes of its channel: a
prefork job fetched before a Redis restart may end after the reconnect, its acknowledgement deferred on the QoS of
the channel the restart closed (applied at the next tick, or remembered). A second lost connection before that tick
makes Celery's `Consumer.on_close` forget the requests it holds, and the delivery step gives up the leases of those
not running (`Leases.drop`): a settling delivery is not among them, so its acknowledgement is never fenced by its own
worker's release and its job never swept and run again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.asynchronous import get_event_loop

from pipeline.compat.results import OneTripStore, Stored, lease_of
from pipeline.flows import record
from pipeline.flows.record import Carried

log = logging.getLogger(__name__)

#: The QoS whose delivery runs on this thread now (`delivering`), per thread: a solo worker's job hands its result
#: to the delivery it runs in, never to another worker's.
_current = threading.local()


def loop_hub() -> Any:
    """The event loop (kombu's hub) when called on its thread, else None."""
    hub = get_event_loop()
    if hub is None or getattr(hub, "_loop_thread", None) != threading.get_ident():
        return None
    return hub


class DeferredAcks:
    """The deferral, mixed into the transport's QoS (which gives `channel` and `_fenced_ack`)."""

    channel: Any
    _deferred_acks: list[str] | None = None
    _deferred_results: list[Stored] | None = None
    #: Nodes for the next call to record, each with its job's delivery tag.
    _deferred_nodes: list[tuple[Carried, str]] | None = None
    #: Tags whose node is carried and not answered yet -> whether their job was acknowledged meanwhile.
    _node_waits: dict[str, bool] | None = None
    #: Tags whose node had no answer and whose lease was given up: their acknowledgement is never sent.
    _given_up: set[str] | None = None
    _ack_client: Any = None

    def _fenced_ack(self, delivery_tag: str) -> None:
        raise NotImplementedError

    def ack_now_or_defer(self, delivery_tag: str) -> None:
        if self._node_waits and delivery_tag in self._node_waits:
            self._node_waits[delivery_tag] = True  # sent once its node's answer came (`_node_done`)
            return
        if self._given_up and delivery_tag in self._given_up:
            self._given_up.discard(delivery_tag)  # its job is delivered again
            return
        hub = loop_hub()
        if hub is None:
            self._fenced_ack(delivery_tag)
            return
        if self._deferred_acks is None:
            self._deferred_acks = []
        self._deferred_acks.append(delivery_tag)
        # Leaving this worker from now on, whatever becomes of this channel: never given up with a lost connection
        # (`Leases.drop`), stopped (`Leases.due`) or reported lost while it waits here for a call to carry it.
        self.channel.leases.settling([delivery_tag])
        hub.on_tick.add(self.flush_acks)

    def carry_result(self, stored: Stored) -> bool:
        """Keep a result for the call that writes the deferred acknowledgements (on the loop's thread only)."""
        hub = loop_hub()
        if hub is None:
            return False
        if self._deferred_results is None:
            self._deferred_results = []
        self._deferred_results.append(stored)
        hub.on_tick.add(self.flush_acks)
        return True

    def carry_node(self, node: Carried, request: Any) -> bool:
        """Keep a fan-out item's node for the next call to record (on the loop's thread, for a leased delivery)."""
        hub = loop_hub()
        tag, _owner = lease_of(request)
        if hub is None or not tag:
            return False
        if self._deferred_nodes is None:
            self._deferred_nodes = []
        if self._node_waits is None:
            self._node_waits = {}
        self._deferred_nodes.append((node, tag))
        self._node_waits[tag] = False
        hub.on_tick.add(self.flush_acks)
        return True

    def fetched(self, tag: str) -> None:
        """Delivery `tag` was fetched again (its lease given up before): its next acknowledgement is sent."""
        if self._given_up:
            self._given_up.discard(tag)

    def has_deferred(self) -> bool:
        return bool(self._deferred_acks or self._deferred_results or self._deferred_nodes)

    def take_acks(self) -> tuple[list[str], list[Stored], list[tuple[Carried, str]]]:
        """The deferred acknowledgements, results and nodes, for a fetch to carry."""
        tags, self._deferred_acks = self._deferred_acks or [], None
        results, self._deferred_results = self._deferred_results or [], None
        nodes, self._deferred_nodes = self._deferred_nodes or [], None
        return tags, results, nodes

    def nodes_answered(self, nodes: list[tuple[Carried, str]], answers: list[Any]) -> None:
        """The call that carried `nodes` answered (4 fields each): each node's `answered`, then its job's
        acknowledgement."""
        for i, (node, tag) in enumerate(nodes):
            done = Carried.answer(answers[4 * i : 4 * i + 4])
            self._node_done(node, tag, lambda node=node, done=done: node.answered(done))

    def nodes_lost(self, nodes: list[tuple[Carried, str]]) -> None:
        """The call that carried `nodes` got no answer (it may not have run): each is recorded by a call of its own,
        which waits for Redis (a node recorded already stays as it is), then its job is acknowledged; only a node
        that still cannot be recorded has its job given up, delivered again."""
        self._record_now(nodes)

    def _record_now(self, nodes: list[tuple[Carried, str]]) -> None:
        for node, tag in nodes:
            self._node_done(node, tag, lambda node=node: node.answered(node.record_now()))

    def _node_done(self, node: Carried, tag: str, then: Any) -> None:
        try:
            then()
        except Exception as exc:  # noqa: BLE001  # Redis away, a publish refused: the job's next delivery does it
            self._give_up(node, tag, exc)
            return
        if (self._node_waits or {}).pop(tag, False):
            self.ack_now_or_defer(tag)

    def _give_up(self, node: Carried, tag: str, exc: BaseException | None) -> None:
        if not (self._node_waits or {}).pop(tag, False):
            if self._given_up is None:
                self._given_up = set()
            self._given_up.add(tag)  # acknowledged later: not sent
        self.channel.leases.drop([tag])
        log.warning("flow %s: %s not known to be recorded (%r); its job runs again", node.flow_id, node.node, exc)

    def flush_acks(self, carry: bool = True) -> None:
        """Write the deferred results and acknowledgements in one fenced call, unless (`carry`) a fetch can carry
        them: one about to be sent in this loop iteration, or the next one after the fetch in flight (its reply
        wakes the loop). Left for a fetch, they are looked at again at each tick until one took them."""
        if self.has_deferred() and carry and self.channel._fetch_soon():
            return
        hub: Any = get_event_loop()
        if hub is not None:
            hub.on_tick.discard(self.flush_acks)
        tags, results, nodes = self.take_acks()
        if nodes:
            self._record_now(nodes)  # their acknowledgements are deferred again: the next tick writes them
        if not tags and not results:
            return
        try:
            if self.channel.closed or self.channel._closing or self.channel.connection is None:
                raise redis.exceptions.ConnectionError("the channel is closed")
            if self._ack_client is None:
                self._ack_client = self.channel._create_client()
            self.channel.leases.settle(self._ack_client, tags, results)
        except self.channel.connection_errors as exc:
            self.channel.leases.remember(tags, exc, results)


@contextmanager
def delivering(qos: DeferredAcks) -> Iterator[None]:
    """While a delivery runs: a solo worker's job, running inside it, hands its result to `qos`."""
    outer = getattr(_current, "qos", None)
    _current.qos = qos
    try:
        yield
    finally:
        _current.qos = outer


def current_qos() -> DeferredAcks | None:
    """The QoS whose delivery runs on this thread now (`delivering`), if any."""
    return getattr(_current, "qos", None)


def carry(stored: Stored, request: Any) -> bool:
    """The result backend's carrier: True when a delivery on this thread took the result (see the module doc)."""
    qos = getattr(_current, "qos", None)
    if not isinstance(qos, DeferredAcks) or getattr(request, "chord", None):  # a cluster channel's carries nothing
        return False
    return qos.carry_result(stored)


def carry_node(node: Carried, request: Any) -> bool:
    """The flows' carrier (`pipeline.flows.record.CARRIERS`): True when a delivery on this thread took the node."""
    qos = getattr(_current, "qos", None)
    return isinstance(qos, DeferredAcks) and qos.carry_node(node, request)


def enable_carried_results() -> None:
    """In a solo worker (or the asyncio pool's, whose async jobs go on `delivering` their QoS again): its jobs'
    results are stored with their acknowledgements, and its fan-out items' nodes recorded by the same calls."""
    OneTripStore.carrier = staticmethod(carry)  # a plain function, not a method of the backend
    record.CARRIERS[:] = [carry_node]


#: What Celery schedules on the event loop to settle a job (`Consumer.call_soon_ack`): a vine promise of the message's
#: `ack_log_error` or `reject_log_error`.
_SETTLING = frozenset({"ack_log_error", "reject_log_error"})


def _settles(item: Any) -> bool:
    fun = getattr(item, "fun", None)
    return getattr(fun, "__name__", None) in _SETTLING and getattr(fun, "__self__", None) is not None


def land(hub: Any, qoses: Iterable[DeferredAcks] = ()) -> None:
    """At a shutdown, outside the event loop's iteration: land what the jobs that ended have to write, before the
    connection closes. Celery schedules each acknowledgement (or requeue) for the loop's next iteration, which a
    stopping worker never runs (kombu runs what is left only as its hub closes, after the connection did): those are
    taken from the hub (`Hub._ready`, under `Hub._ready_lock`) and run now; then every deferred acknowledgement and
    result of their QoS and of `qoses` is written, one call per QoS (`flush_acks`). No call when nothing waits."""
    due: list[Any] = []
    if hub is not None:
        with hub._ready_lock:
            due = [item for item in hub._ready if _settles(item)]
            hub._ready.difference_update(due)
    touched = {qos for qos in qoses if isinstance(qos, DeferredAcks)}  # a cluster channel's acknowledges at once
    for item in due:
        item()
        qos = getattr(getattr(item.fun.__self__, "channel", None), "qos", None)
        if isinstance(qos, DeferredAcks):
            touched.add(qos)
    for qos in touched:
        qos.flush_acks(carry=False)
