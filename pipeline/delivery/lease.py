"""Leases on the deliveries a worker holds: renewal, fencing, and acknowledgements that wait out an outage.

Every delivery a worker fetches (`pipeline.delivery.fetch`: one Lua script pops the messages and records them in
kombu's `unacked`/`unacked_index`, plus `pipeline:lease` tag → the worker's incarnation id) is held in its
`Leases` until it is acknowledged, requeued, or found lost. `Leases` is the whole of what the delivery layer knows
about one worker's deliveries: the tags held, lost, settling, dropped, the acknowledgements and results waiting for
Redis, and the renewal clock. The worker's delivery bootstep (`pipeline.delivery.fencing.DeliveryStep`) creates it,
binds the worker's transport to it (`pipeline.delivery.transport.bound`) and starts and stops its renewal thread,
so two workers in one process never share it.

A daemon thread of the worker's main process (`Renewer`: `pipeline.delivery.renewer`), with its own Redis client (so
a busy event loop, a blocked pool child or the solo/threads pools never stop it), renews every held delivery each
LEASE_SECONDS/3 with one Lua call (`renew.lua`: the index score becomes Redis's clock (TIME) + LEASE_SECONDS, rounded
up to the whole second, where `pipeline:lease` still names this worker; on a Redis Cluster one call per queue, in its
slot), returning the tags it no longer owns. kombu's sweep (`restore_visible`) restores a tag whose index score (its
lease's expiry) has passed by Redis's clock: the holder died or was cut off. No host's clock enters a lease, so a worker
whose clock is off neither loses its jobs nor takes a peer's.

Fencing: a tag whose lease is gone was (or will be) delivered to a peer. The worker must neither run nor
acknowledge it: the delivery step drops a reserved request without running it and terminates a running one;
`Request.revoked` (`pipeline.delivery.request`) refuses a lost one that reaches the pool later; and every
acknowledgement is the fenced `settle.lua`, which removes the delivery only while this worker owns it.

An acknowledgement that cannot reach Redis (the connection dropped as the job finished) is remembered and applied,
fenced, by the renewal thread once Redis answers again; the delivery is renewed meanwhile. So is a result that was to
be stored with it (a solo worker stores a job's SUCCESS in the call that acknowledges the job), written first.

Cut off: each held tag's lease was last confirmed by the fetch or the renewal call that last reached Redis (the
time the call was sent: Redis reads its clock later, so the lease lasts at least `lease_seconds` from then).
`due` names the tags whose lease would lapse soon without a renewal; `give_up` stops holding them (no longer renewed,
`is_lost` true) so the worker stops their jobs before the lease lapses (`pipeline.runtime.lapses`): on the worker's
own clock, with no Redis call, however long a renewal call hangs.

After an outage every index score looks expired. `sweep_allowed` lets this worker sweep only once its renewals have
succeeded for a whole lease without a failure (or a gap longer than the lease), so every live worker has renewed by
then, and only while its last renewal is recent (a worker thawed after a freeze renews, and finds what it lost,
before it sweeps).

On a Redis Cluster the renewal thread applies acknowledgements, releases and renewals queue by queue: a queue whose
slot is moving (its scripts refused with TRYAGAIN) is skipped for the pass, the others go on
(`pipeline.delivery.moving`).

Celery forgets the requests it had prefetched or scheduled when the consumer's connection drops
(`Consumer.on_close`); `drop` gives their leases up (`release.lua`), so a sweep puts them back on their queues.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from redis.exceptions import ResponseError

from pipeline.compat.results import Stored
from pipeline.constants import DELIVERIES_KEY, DELIVERY_LOG_KEY, LEASE_KEY, UNACKED_INDEX_KEY, UNACKED_KEY
from pipeline.delivery import moving, replicas
from pipeline.delivery.moving import Moving
from pipeline.delivery.renewer import RenewalClock
from pipeline.delivery.renewer import Renewer as Renewer  # the renewal thread, in a module of its own
from pipeline.lua import script
from pipeline.observability import metrics
from pipeline.queues import keys
from pipeline.queues.keys import Records

log = logging.getLogger(__name__)

#: Tags renewed per Lua call (a worker holds its prefetch, so one call in practice).
RENEW_BATCH = 500
#: The delivery history's key prefix (`pipeline:deliveries:<tag>`).
HISTORY_PREFIX = DELIVERY_LOG_KEY.format(tag="")

#: The delivery records of every queue on a single Redis (`pipeline.queues.keys.records`: per queue on a cluster).
SINGLE: Records = (UNACKED_KEY, UNACKED_INDEX_KEY, LEASE_KEY, DELIVERIES_KEY, HISTORY_PREFIX)


def records(queue: str) -> Records:
    """The delivery records of `queue` on a Redis Cluster (all in the queue's slot)."""
    return keys.records(queue, True)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Leases(RenewalClock):
    """One worker's deliveries and their leases (see the module doc), shared by the loop, pool and renewal threads."""

    def __init__(self, lease_seconds: float = 30.0, node: str | None = None, cluster: bool = False) -> None:
        super().__init__(lease_seconds)
        self._node = node
        #: On a Redis Cluster each queue keeps its delivery records in its own slot: the queue of each tag (`hold`).
        self.cluster = cluster
        self._queues: dict[str, str] = {}
        self._lock = threading.Lock()
        self._owner: str | None = None
        #: Delivery tags this worker holds (fetched, not yet acknowledged, requeued or lost).
        self._held: set[str] = set()
        #: Tags whose lease a peer took: fenced by the event loop, refused by `Request.revoked`.
        self._lost: set[str] = set()
        #: Tags acknowledged while Redis was unreachable: applied (fenced) by the renewal thread.
        self._pending_acks: set[str] = set()
        #: Results that were to be stored with an acknowledgement while Redis was unreachable: stored first.
        self._pending_results: list[Stored] = []
        #: Tags Celery dropped without running (its consumer's `on_close` after a lost connection): released by the
        #: renewal thread, so a sweep puts them back on their queues.
        self._dropped: set[str] = set()
        #: Tags a call is taking out of this worker's hands now, with their lease records (an acknowledgement, the
        #: holder's requeue: `settling`): a renewal running after that call in Redis must not report them lost.
        self._settling: set[str] = set()
        #: Monotonic time each held tag's lease was last confirmed (fetched, or renewed: when the call was sent).
        self._confirmed: dict[str, float] = {}
        #: Tags given up because their lease could not be renewed in time (`give_up`): monotonic time each lapses.
        self._lapsing: dict[str, float] = {}
        self._renewing = threading.Lock()  # one renewal at a time: the thread's, or the last one at shutdown
        #: The queues whose slot refused a call as moving (a cluster: `pipeline.delivery.moving`).
        self.moving = Moving()

    def owner(self) -> str:
        """This worker process's incarnation id (hostname, pid, a random part): what `pipeline:lease` records."""
        with self._lock:
            if self._owner is None or self._owner.split(":")[1] != str(os.getpid()):  # a forked child is not it
                self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
            return self._owner

    def node(self) -> str:
        """The worker's node name as Celery reports it (`name@host`), or the host name when it has none."""
        return self._node or socket.gethostname()

    def hold(self, tag: str, queue: str | None = None) -> None:
        with self._lock:
            if queue is not None:
                self._queues[tag] = queue
            self._held.add(tag)
            self._lost.discard(tag)
            self._lapsing.pop(tag, None)
            self._confirmed[tag] = time.monotonic()

    def rehold(self, tag: str) -> bool:
        """True (and `tag` held again, no longer lost) when this worker already holds a delivery of `tag`, or one
        awaiting its fence: fetched anew after its lease expired (this worker was frozen and a sweep put it back)."""
        with self._lock:
            if tag not in self._held and tag not in self._lost:
                self._lapsing.pop(tag, None)  # its copy here was stopped (`give_up`): the new delivery runs
                return False
            self._held.add(tag)
            self._lost.discard(tag)
            self._confirmed[tag] = time.monotonic()
            return True

    def release(self, tag: str) -> None:
        with self._lock:
            self._held.discard(tag)
            self._confirmed.pop(tag, None)
            self._pending_acks.discard(tag)
            self._settling.discard(tag)
            if tag not in self._dropped:
                self._queues.pop(tag, None)

    def by_records(self, tags: Iterable[str]) -> list[tuple[Records, list[str]]]:
        """`tags` grouped by the delivery records they are kept in: one group on a single Redis (also when empty),
        one per queue on a cluster (a tag of no known queue is left out: it was never fetched here)."""
        if not self.cluster:
            return [(SINGLE, list(tags))]
        with self._lock:
            groups: dict[str, list[str]] = {}
            for tag in tags:
                if tag in self._queues:
                    groups.setdefault(self._queues[tag], []).append(tag)
        return [(records(queue), group) for queue, group in groups.items()]

    def settling(self, tags: Iterable[str]) -> None:
        """`tags` leave by a call sent now (a fetch carrying their acks, `leaving`) or deferred to one (`acks`): until
        `release` or the call's failure (`remember_ack`), not reported lost, stopped (`due`) or given up (`drop`)."""
        with self._lock:
            self._settling.update(tags)

    @contextmanager
    def leaving(self, tags: list[str]) -> Iterator[None]:
        """`settling` around a synchronous call (`settle`, the holder's requeue); if it fails, `tags` are held again."""
        self.settling(tags)
        try:
            yield
        except BaseException:
            with self._lock:
                self._settling.difference_update(tags)
            raise

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def is_lost(self, tag: str | None) -> bool:
        """A peer took the lease of `tag`, or this worker gave it up (`give_up`): the job must not run here."""
        with self._lock:
            return tag is not None and (tag in self._lost or tag in self._lapsing)

    def take_lost(self) -> set[str]:
        """The tags found lost and not fenced yet (each kept until `forget_lost`, or held again)."""
        with self._lock:
            return set(self._lost)

    def forget_lost(self, tags: Iterable[str]) -> None:
        with self._lock:
            for tag in tags:
                self._lost.discard(tag)
                self._lapsing.pop(tag, None)

    def due(self, before_lapse: float, now: float | None = None) -> set[str]:
        """Held tags whose lease lapses within `before_lapse` seconds of `now` (its last confirmation plus
        `lease_seconds`): the renewals could not reach Redis in time. A job that ended (its acknowledgement waits
        for Redis, or is on its way) is not among them: nothing of it runs any more."""
        now = time.monotonic() if now is None else now
        limit = now + before_lapse - self.lease_seconds
        with self._lock:
            running = self._held - self._pending_acks - self._settling
            return {tag for tag in running if self._confirmed.get(tag, now) <= limit}

    def give_up(self, tags: Iterable[str]) -> dict[str, float]:
        """Stop holding `tags` (`due`): not renewed, their jobs to be stopped (`is_lost`: one not started never runs
        here); returns each with the monotonic time its lease lapses. Nothing is written to Redis: the lease lapses,
        and a sweep (a peer's, or this worker's after the heal) puts the job back on its queue."""
        given: dict[str, float] = {}
        with self._lock:
            for tag in set(tags) & self._held:
                self._held.discard(tag)
                lapse = self._confirmed.pop(tag, time.monotonic()) + self.lease_seconds
                given[tag] = self._lapsing[tag] = lapse
        if given:
            metrics.leases.labels(outcome="lapsed").inc(len(given))
        return given

    def lapsing(self) -> dict[str, float]:
        """The tags given up whose jobs may still be stopping here, each with the monotonic time its lease lapses."""
        with self._lock:
            return dict(self._lapsing)

    def drop(self, tags: Iterable[str]) -> None:
        """Stop holding `tags` (the worker forgot them unrun): their leases are given up for a sweep to restore."""
        with self._lock:
            # An acknowledged job is done: never given back.
            tags = (set(tags) & self._held) - self._pending_acks - self._settling
            self._held.difference_update(tags)
            for tag in tags:
                self._confirmed.pop(tag, None)
            self._dropped.update(tags)
        if tags:
            self._wake.set()
            metrics.leases.labels(outcome="released").inc(len(tags))
            log.warning(
                "released %d prefetched job(s) dropped with a lost connection: back on their queues soon", len(tags)
            )

    def pending_acks(self) -> int:
        with self._lock:
            return len(self._pending_acks)

    def remember_ack(self, tag: str, exc: BaseException) -> None:
        """An acknowledgement whose outcome is unknown: the renewal thread applies it (after remembered results)."""
        with self._lock:
            self._pending_acks.add(tag)
            self._settling.discard(tag)  # renewed again until the renewal thread applies it
        self._wake.set()
        log.warning("could not acknowledge a job now (%r); acknowledging it (if still ours) once Redis takes it", exc)

    def remember_results(self, results: Iterable[Stored], exc: BaseException) -> None:
        """Results whose write's outcome is unknown: stored by the renewal thread (a SUCCESS is never overwritten)."""
        with self._lock:
            self._pending_results.extend(results)
        self._wake.set()
        log.warning("could not store job results now (%r); storing them on reconnect", exc)

    def remember(self, tags: list[str], exc: BaseException, results: list[Stored] | None = None) -> None:
        """Acknowledgements (and results to store first) of unknown outcome: applied, fenced, by the renewal thread."""
        if results:
            self.remember_results(results, exc)
        for tag in tags:
            self.remember_ack(tag, exc)

    def ack(self, client: Any, tag: str) -> bool:
        """Remove `tag` from Redis if this worker still holds its lease (fenced); forget it either way."""
        return tag not in self.settle(client, [tag])

    def settle(self, client: Any, tags: list[str], results: list[Stored] | None = None) -> set[str]:
        """Store `results`, then `ack` every tag, in one call (`settle.lua`; one per queue on a cluster, where no
        results are carried: they are stored on their own); returns the fenced tags (each logged)."""
        results = results or []
        fenced: list[Any] = []
        sent = time.monotonic()
        with self.leaving(tags):
            for records_, group in self.by_records(tags):
                keys_: list[Any] = [*records_[:4], *(r[0] for r in results)]
                values = [x for _key, value, expires, tag in results for x in (value, expires, tag)]
                args = [self.owner(), records_[4], len(results), *values, *group]
                try:
                    fenced += replicas.run(client, "settle", keys_, args, "an acknowledgement")
                except ResponseError as exc:  # one delivery's, stopped at its history (moved): its records removed
                    if len(group) > 1 or not moving.non_local(exc):
                        raise
                results = []
        return self.settled(tags, fenced, sent)

    def settled(self, tags: list[str], fenced_reply: list[Any], sent: float | None = None) -> set[str]:
        """After a call that acknowledged `tags` (sent at monotonic `sent`): forget them; log, return those it fenced.
        A remembered one, surely ours when sent (confirmed under a lease before), was applied by the call it retries."""
        fenced, lease = {_text(x) for x in fenced_reply}, self.lease_seconds
        with self._lock:
            ours = {t for t in fenced & self._pending_acks if sent and sent - self._confirmed.get(t, -lease) < lease}
        for tag in tags:
            self.release(tag)
        for tag in sorted(fenced - ours):
            log.warning("delivery %s: lease lost to another worker; acknowledgement ignored (fenced)", tag)
        for tag in sorted(ours):
            log.info("delivery %s: acknowledged already, by an earlier call whose reply was lost", tag)
        return fenced

    def has_pending(self) -> bool:
        """Acknowledgements, results or given-up leases the renewal thread has still to write."""
        with self._lock:
            return bool(self._pending_acks or self._pending_results or self._dropped)

    def renew_once(self, client: Any) -> set[str]:
        """Apply remembered acknowledgements, renew every held lease; return the tags found lost."""
        with self._renewing:
            return self._renew(client)

    def _renew(self, client: Any) -> set[str]:
        with self._lock:
            results, acks, dropped = list(self._pending_results), list(self._pending_acks), list(self._dropped)
        if results or acks:  # the results first, in the same call (a single Redis: one group; none on a cluster)
            groups = self.by_records(acks)
            if self.cluster:  # one delivery a call: one stopped at its moved history acknowledged it (`settle`)
                groups = [(records_, [tag]) for records_, group in groups for tag in group]
            waiting = self.moving.each(groups, lambda _records, tags: self.settle(client, tags, results))
            with self._lock:
                del self._pending_results[: len(results)]
            if applied := len(acks) - len(waiting):
                log.info("applied %d acknowledgement(s) the broker could not take when they were made", applied)
        release = script("release")
        kept = self.moving.each(
            self.by_records(dropped) if dropped else [],
            lambda records_, group: release(keys=list(records_[1:3]), args=[self.owner(), *group], client=client),
        )
        with self._lock:
            self._dropped.difference_update(set(dropped) - kept)
            for tag in set(dropped) - kept:
                self._queues.pop(tag, None)
        lease = repr(self.lease_seconds)  # the script adds it to Redis's clock: the index holds each expiry
        lost: set[str] = set()
        renew = script("renew")

        def renew_queue(records_: Records, tags: list[str]) -> None:
            for start in range(0, len(tags), RENEW_BATCH):
                batch = tags[start : start + RENEW_BATCH]
                sent = time.monotonic()  # Redis's clock read in the script is later: the lease lasts at least this
                reply = renew(keys=[records_[1], records_[2]], args=[self.owner(), lease, *batch], client=client)
                found = {_text(x) for x in reply}
                lost.update(found)
                with self._lock:
                    for tag in batch:
                        if tag in self._held and tag not in found:
                            self._confirmed[tag] = sent

        # A moving queue's leases are left unconfirmed: `due` names them in time, as when Redis cannot be reached.
        self.moving.each(self.by_records(sorted(self.held())), renew_queue)
        with self._lock:
            # A tag that left this worker since the snapshot (acknowledged or requeued by a call that ran in Redis
            # before the renewal) has no lease left, yet is not lost: it is settling, or settled and no longer held.
            lost = (lost & self._held) - self._settling
            self._held.difference_update(lost)
            self._lost.update(lost)
            for tag in lost:
                self._confirmed.pop(tag, None)
        if lost:
            metrics.leases.labels(outcome="lost").inc(len(lost))
            log.error(
                "lease lost on %d delivery(ies) (a peer may run them): they will not run or be acknowledged here",
                len(lost),
            )
        return lost
