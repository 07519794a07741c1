"""A queue whose slot is moving between two masters of a Redis Cluster: what a worker does while it is.

While a slot moves (`CLUSTER SETSLOT ... MIGRATING` and `IMPORTING`, then `MIGRATE` of its keys a batch at a time, as
`redis-cli --cluster reshard` does), a command naming several keys of the slot is served only where all of them are:
the source sends one with a key it lacks to the target (ASK), and the target refuses it with TRYAGAIN unless it holds
them all. Every script of a queue names several of its keys. A fetch names some that exist on neither master (an
empty priority list, the paused flag), so it is refused from the moment the slot starts moving until the move ends;
an acknowledgement, a renewal or a restore names the delivery records, and is refused once one of them has moved.
redis-py's cluster client retries a refused call, 16 tries over about 0.4 s, then raises `ClusterError`; the other
queues, on their own slots, answer as usual.

What the worker does, so that one moving queue holds up no other:

* the channel's client gives up on a call after TRIES tries (`impatient`): a refused fetch holds the event loop for a
  few round trips instead of 0.4 s; an ASK or a MOVED, followed, still gets its answer within them;
* a fetch refused skips its queue for the round (`Moving.skip`) and the round goes on to the other queues; the queue
  is fetched again at its next round (its wake-up marker, or the fallback poll): no reconnect, nothing dropped;
* an acknowledgement refused is remembered (`Leases.remember_ack`) and retried by the renewal thread, which applies
  acknowledgements, releases and renewals queue by queue and skips a moving queue for the pass: the other queues'
  leases are renewed as usual. A refused acknowledgement is neither dropped nor taken as fenced. A script that
  ran where a delivery's records were and stopped at its history, moved already (`NON_LOCAL`), removed the records
  first: an acknowledgement of that one delivery is made (`Leases.settle`; the renewal thread retries its
  acknowledgements one delivery a call on a cluster), and the history lapses with its TTL;
* the renewals of a moving queue's leases are refused too: a job of it still running two renewal periods after its
  lease was last confirmed is stopped before its lease lapses (`pipeline.runtime.lapses`), as when Redis cannot be
  reached, and runs again after the move. A job that ended keeps its remembered acknowledgement, applied (fenced) once
  the slot has moved;
* the sweep leaves a queue alone until a whole lease has passed since its slot last refused a call here
  (`Moving.steady_for`): a job whose lease lapsed during the move while its acknowledgement waited is acknowledged by
  its worker (which retries every second) before any sweep could put it back on its queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from redis.exceptions import ClusterError, ResponseError, TryAgainError

from pipeline.queues.keys import Records, tagged_queue

log = logging.getLogger(__name__)

#: What redis-py raises on a call to a moving slot (`is_moving` tells which are): TRYAGAIN itself (a cluster pipeline
#: passes it on), `ClusterError` once its tries are spent (ASK, TRYAGAIN and MOVED answers followed; its subclass
#: `ClusterDownError`, a slot with no master, is an outage), or the error of a script that ran where all the keys it
#: names were and then reached one moved away (`NON_LOCAL`).
ERRORS: tuple[type[Exception], ...] = (ResponseError, ClusterError)
#: What Redis answers a script that reaches a key of a moving slot the node does not hold (a key the script builds,
#: such as a delivery's history): the script stops there, its earlier writes made.
NON_LOCAL = "Script attempted to access a non local key in a cluster node"
#: The tries of one call of a worker channel's client (redis-py's `RedisClusterRequestTTL`: 16 by default, pausing
#: 50 ms after each of the last eight). An ASK, or a MOVED with the map refreshed, then the answer, take two.
TRIES = 4
#: A queue refused again within this long after its last refusal is not logged again (seconds).
LOG_AGAIN_S = 60.0


def is_moving(exc: BaseException) -> bool:
    """Whether `exc` is a cluster's answer for a slot on its way between two masters."""
    return isinstance(exc, TryAgainError) or type(exc) is ClusterError or non_local(exc)


def non_local(exc: BaseException) -> bool:
    """Whether `exc` is a script's stop at a key moved away (`NON_LOCAL`)."""
    return type(exc) is ResponseError and NON_LOCAL in str(exc)


def impatient(client: Any) -> Any:
    """`client` (a redis-py `RedisCluster`) giving up on a call after TRIES tries."""
    client.RedisClusterRequestTTL = TRIES  # read from the instance at each call
    return client


def tagged(name: str) -> str:
    """The queue a key of a cluster names in its hash tag (`keys.tagged_queue`: `pipeline:{<q>}:unacked` gives `<q>`);
    a key with none (a single Redis's records) as it is."""
    return tagged_queue(name) or name


class Moving:
    """The queues whose slot refused a call of this worker as moving, and when each last did (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refused: dict[str, float] = {}

    def skip(self, queue: str, exc: BaseException) -> None:
        """Note that `queue`'s slot refused a call as moving (logged once a move); raise `exc` when it is not that."""
        if not is_moving(exc):
            raise exc
        now = time.monotonic()
        with self._lock:
            last = self._refused.get(queue)
            self._refused[queue] = now
        if last is None or now - last > LOG_AGAIN_S:
            log.warning("queue %s: its slot is moving (%r); skipped until its keys are on one master again", queue, exc)

    @contextmanager
    def skipping(self, queue: str) -> Iterator[None]:
        """Around a call on `queue`'s slot: a refusal as moving is noted (`skip`) and goes no further."""
        try:
            yield
        except ERRORS as exc:
            self.skip(queue, exc)

    def each(self, groups: list[tuple[Records, list[str]]], call: Callable[[Records, list[str]], Any]) -> set[str]:
        """`call` on each queue's records and tags (`Leases.by_records`: one group on a single Redis); returns the tags
        of the groups skipped, their queue's slot moving: left for the next pass."""
        skipped: set[str] = set()
        for records, tags in groups:
            skipped.update(tags)
            with self.skipping(tagged(records[0])):
                call(records, tags)
                skipped.difference_update(tags)
        return skipped

    def steady_for(self, queue: str, seconds: float) -> bool:
        """True unless `queue`'s slot refused a call here as moving within the last `seconds`."""
        with self._lock:
            last = self._refused.get(queue)
        return last is None or time.monotonic() - last >= seconds
