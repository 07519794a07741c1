"""Leases on the deliveries a worker holds: renewal, fencing, and acknowledgements that wait out an outage.

Every delivery this worker fetches (`pipeline.runtime.fetch`: one Lua script pops the messages and records
them in kombu's `unacked`/`unacked_index`, plus `pipeline:lease` tag → this worker's incarnation id) is held
here until it is acknowledged, requeued, or found lost. A daemon thread of the worker's main process, with
its own Redis client (so a busy event loop, a blocked pool child or the solo/threads pools never stop it),
renews every held delivery each LEASE_SECONDS/3 with one Lua call: `ZADD XX unacked_index <expiry> tag`
(expiry = now + LEASE_SECONDS) where `pipeline:lease` still names this worker, returning the tags it no longer
owns. kombu's sweep (`restore_visible`) restores a tag whose index score (its lease's expiry) has passed: the
holder died or was cut off.

Fencing: a tag whose lease is gone was (or will be) delivered to a peer. The worker must neither run nor
acknowledge it: `fence_lost` (run from the event loop by `LeaseStep`) drops a reserved request without
running it and terminates a running one; `Request.revoked` (`pipeline.runtime.request`) refuses a lost one
that reaches the pool later; and every acknowledgement is the fenced `SETTLE` script, which removes the
delivery only while this worker owns it.

An acknowledgement that cannot reach Redis (the connection dropped as the job finished) is remembered and
applied, fenced, by the renewal thread once Redis answers again; the delivery is renewed meanwhile. So is a
result that was to be stored with it (`settle`: a solo worker stores a job's SUCCESS in the script that
acknowledges the job), written before the acknowledgement.

After an outage every index score looks expired. `sweep_allowed` lets this worker sweep only once its
renewals have succeeded for a whole lease without a failure (or a gap longer than the lease), so every live
worker has renewed by then, and only while its last renewal is recent (a worker thawed after a freeze renews,
and finds what it lost, before it sweeps).

Celery forgets the requests it had prefetched or scheduled when the consumer's connection drops
(`Consumer.on_close`); `drop` gives their leases up (`RELEASE`), so a sweep puts them back on their queues.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.config.results import STORE_LUA, Stored
from pipeline.constants import DELIVERIES_KEY, DELIVERY_LOG_KEY, LEASE_KEY, UNACKED_INDEX_KEY, UNACKED_KEY
from pipeline.observability import metrics

log = logging.getLogger(__name__)

#: Tags renewed per Lua call (a worker holds its prefetch, so one call in practice).
RENEW_BATCH = 500

#: KEYS: unacked_index, lease. ARGV: owner, the new expiry, tags... Returns the tags this owner no longer holds.
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[2], tag) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[2], tag)
  else
    lost[#lost + 1] = tag
  end
end
return lost
"""


def ack_lua(first_tag: int | str, owner: int, prefix: int) -> str:
    """Lua acknowledging ARGV[first_tag..] as `ACK` does (KEYS: unacked, unacked_index, lease, deliveries; ARGV[owner]
    the owner, ARGV[prefix] the delivery log's key prefix), leaving the fenced tags in the table `fenced`.
    `first_tag`: an index, or a Lua expression giving one."""
    return f"""
local fenced = {{}}
for i = {first_tag}, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[3], tag) == ARGV[{owner}] then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('DEL', ARGV[{prefix}] .. tag)
  else
    fenced[#fenced + 1] = tag
  end
end
"""


def results_lua(first_key: int | str, count: int) -> str:
    """Lua storing the results a script carries (`STORE_LUA` must come first): ARGV[count] of them, the i-th under
    KEYS[first_key + i] with its encoded meta and expiry in ARGV[count + 2i - 1] and ARGV[count + 2i]. Defines
    `nres`, the number of results. `first_key`: an index, or a Lua expression giving one."""
    return f"""
local nres = tonumber(ARGV[{count}])
local first_result_key = {first_key}
for r = 1, nres do
  store(KEYS[first_result_key + r], ARGV[{count} + 2 * r - 1], ARGV[{count} + 2 * r])
end
"""


#: Results stored, then deliveries acknowledged, in one call. KEYS: unacked, unacked_index, lease, deliveries, then
#: one task key per result. ARGV: owner, the delivery log's key prefix, the number of results n, n pairs (encoded
#: meta, expiry), then the tags. Returns the tags it left alone (fenced: this owner no longer holds them); their
#: results are stored all the same, as the backend stores a result before any acknowledgement.
SETTLE = STORE_LUA + results_lua(4, 3) + ack_lua("4 + 2 * nres", 1, 2) + "return fenced\n"

#: KEYS: unacked_index, lease. ARGV: owner, tags... Gives up this owner's lease on each tag and marks it expired,
#: so the next sweep puts it back on its queue (a delivery the worker dropped without running it).
RELEASE = """
for i = 2, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[2], tag) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', 0, tag)
    redis.call('HDEL', KEYS[2], tag)
  end
end
return 0
"""

_lock = threading.Lock()
_owner: str | None = None
#: Delivery tags this worker holds (fetched, not yet acknowledged, requeued or lost).
_held: set[str] = set()
#: Tags whose lease a peer took: fenced by the event loop, refused by `Request.revoked`.
_lost: set[str] = set()
#: Tags acknowledged while Redis was unreachable: applied (fenced) by the renewal thread.
_pending_acks: set[str] = set()
#: Results that were to be stored with an acknowledgement while Redis was unreachable: stored first.
_pending_results: list[Stored] = []
#: Tags Celery dropped without running (its consumer's `on_close` after a lost connection): released by the
#: renewal thread, so a sweep puts them back on their queues.
_dropped: set[str] = set()
#: Tags a call is taking out of this worker's hands now, with their lease records (an acknowledgement, the holder's
#: requeue: `settling`): a renewal running after that call in Redis must not report them lost.
_settling: set[str] = set()
_lease_seconds = 30.0
_node: str | None = None
_streak_since: float | None = None  # monotonic time of the first renewal of the current unbroken run
_renewed_at: float | None = None  # monotonic time of the last successful renewal
_wake = threading.Event()
_renewing = threading.Lock()  # one renewal at a time: the thread's, or the last one at shutdown


def owner() -> str:
    """This worker process's incarnation id (hostname, pid, a random part): what `pipeline:lease` records."""
    global _owner
    with _lock:
        if _owner is None or _owner.split(":")[1] != str(os.getpid()):  # a forked child is not the holder
            _owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        return _owner


def configure(lease_seconds: float, node: str | None = None) -> None:
    """The lease length, and this worker's node name (`name@host`) for the delivery history."""
    global _lease_seconds, _node
    _lease_seconds = float(lease_seconds)
    if node:
        _node = node


def node() -> str:
    """The worker's node name as Celery reports it (`name@host`), or the host name before the worker set it."""
    return _node or socket.gethostname()


def lease_seconds() -> float:
    return _lease_seconds


def hold(tag: str) -> None:
    with _lock:
        _held.add(tag)
        _lost.discard(tag)


def rehold(tag: str) -> bool:
    """True (and `tag` held again, no longer lost) when this worker already holds a delivery of `tag`, or one
    awaiting its fence: fetched anew after its lease expired (this worker was frozen and the sweep put it back)."""
    with _lock:
        if tag not in _held and tag not in _lost:
            return False
        _held.add(tag)
        _lost.discard(tag)
        return True


def release(tag: str) -> None:
    with _lock:
        _held.discard(tag)
        _pending_acks.discard(tag)
        _settling.discard(tag)


def settling(tags: Iterable[str]) -> None:
    """`tags` leave this worker by a call sent now (a fetch carrying their acknowledgements, or `leaving`): until
    `release` or the call's failure (`remember_ack`), a renewal does not report them lost."""
    with _lock:
        _settling.update(tags)


@contextmanager
def leaving(tags: list[str]) -> Iterator[None]:
    """`settling` around a synchronous call (`settle`, the holder's requeue); if it fails, `tags` are held as before."""
    settling(tags)
    try:
        yield
    except BaseException:
        with _lock:
            _settling.difference_update(tags)
        raise


def held() -> set[str]:
    with _lock:
        return set(_held)


def is_lost(tag: str | None) -> bool:
    with _lock:
        return tag is not None and tag in _lost


def take_lost() -> set[str]:
    """The tags found lost and not fenced yet (each kept until `forget_lost`, or held again)."""
    with _lock:
        return set(_lost)


def forget_lost(tags: Iterable[str]) -> None:
    with _lock:
        _lost.difference_update(tags)


def drop(tags: Iterable[str]) -> None:
    """Stop holding `tags` (the worker forgot them unrun): their leases are given up for a sweep to restore."""
    with _lock:
        tags = (set(tags) & _held) - _pending_acks - _settling  # an acknowledged job is done: never given back
        _held.difference_update(tags)
        _dropped.update(tags)
    if tags:
        _wake.set()
        metrics.leases.labels(outcome="released").inc(len(tags))
        log.warning(
            "released %d prefetched job(s) dropped with a lost connection: back on their queues soon", len(tags)
        )


def pending_acks() -> int:
    with _lock:
        return len(_pending_acks)


def remember_ack(tag: str, exc: BaseException) -> None:
    """An acknowledgement whose outcome is unknown: the renewal thread applies it (after any remembered results)."""
    with _lock:
        _pending_acks.add(tag)
        _settling.discard(tag)  # renewed again until the renewal thread applies it
    _wake.set()
    log.warning("could not acknowledge a job now (%r); acknowledging it (if still ours) on reconnect", exc)


def remember_results(results: Iterable[Stored], exc: BaseException) -> None:
    """Results whose write had an unknown outcome: stored by the renewal thread (a SUCCESS is never overwritten)."""
    with _lock:
        _pending_results.extend(results)
    _wake.set()
    log.warning("could not store job results now (%r); storing them on reconnect", exc)


def sweep_allowed() -> bool:
    """True once this worker's renewals have succeeded without a break for a whole lease (see the module doc),
    the last one recently: a worker that was frozen renews (or finds its leases lost) before it sweeps."""
    with _lock:
        now = time.monotonic()
        return (
            _streak_since is not None
            and now - _streak_since >= _lease_seconds
            and _renewed_at is not None
            and now - _renewed_at <= _lease_seconds / 2
        )


def _renewed(ok: bool) -> None:
    """Record a renewal's outcome: a failure, or a gap longer than the lease, starts the run over."""
    global _streak_since, _renewed_at
    now = time.monotonic()
    with _lock:
        if not ok or (_renewed_at is not None and now - _renewed_at > _lease_seconds):
            _streak_since = None
        if ok and _streak_since is None:
            _streak_since = now
        _renewed_at = now if ok else None


def ack(client: Any, tag: str) -> bool:
    """Remove `tag` from Redis if this worker still holds its lease (fenced); forget it either way."""
    return tag not in settle(client, [tag])


def settle(client: Any, tags: list[str], results: list[Stored] | None = None) -> set[str]:
    """Store `results`, then `ack` every tag, in one call (`SETTLE`); returns the fenced tags (each logged)."""
    prefix = DELIVERY_LOG_KEY.format(tag="")
    results = results or []
    keys = [UNACKED_KEY, UNACKED_INDEX_KEY, LEASE_KEY, DELIVERIES_KEY, *(key for key, _value, _expires in results)]
    values = [x for _key, value, expires in results for x in (value, expires)]
    with leaving(tags):
        reply = client.eval(SETTLE, len(keys), *keys, owner(), prefix, len(results), *values, *tags)
    return settled(tags, reply)


def settled(tags: list[str], fenced_reply: list[Any]) -> set[str]:
    """After a call that acknowledged `tags`: forget them, log the ones it fenced (`fenced_reply`); those."""
    fenced = {x.decode() if isinstance(x, bytes) else str(x) for x in fenced_reply}
    for tag in tags:
        release(tag)
    for tag in sorted(fenced):
        log.warning("delivery %s: lease lost to another worker; acknowledgement ignored (fenced)", tag)
    return fenced


def has_pending() -> bool:
    """Acknowledgements, results or given-up leases the renewal thread has still to write."""
    with _lock:
        return bool(_pending_acks or _pending_results or _dropped)


def renew_once(client: Any, now: float | None = None) -> set[str]:
    """Apply remembered acknowledgements, renew every held lease; return the tags found lost."""
    with _renewing:
        return _renew(client, now)


def _renew(client: Any, now: float | None) -> set[str]:
    with _lock:
        results, acks = list(_pending_results), list(_pending_acks)
    if results or acks:
        settle(client, acks, results)  # the results first, in the same call
        with _lock:
            del _pending_results[: len(results)]
    if acks:
        log.info("applied %d acknowledgement(s) made while the broker was unreachable", len(acks))
    with _lock:
        dropped = list(_dropped)
    if dropped:
        client.eval(RELEASE, 2, UNACKED_INDEX_KEY, LEASE_KEY, owner(), *dropped)
        with _lock:
            _dropped.difference_update(dropped)
    tags = sorted(held())
    stamp = repr((time.time() if now is None else now) + _lease_seconds)  # the index holds when each lease expires
    lost: set[str] = set()
    for start in range(0, len(tags), RENEW_BATCH):
        batch = tags[start : start + RENEW_BATCH]
        lost.update(
            x.decode() if isinstance(x, bytes) else str(x)
            for x in client.eval(RENEW, 2, UNACKED_INDEX_KEY, LEASE_KEY, owner(), stamp, *batch)
        )
    with _lock:
        # A tag that left this worker since the snapshot (acknowledged or requeued by a call that ran in Redis
        # before the renewal) has no lease left, yet is not lost: it is settling, or settled and no longer held.
        lost = (lost & _held) - _settling
        _held.difference_update(lost)
        _lost.update(lost)
    if lost:
        metrics.leases.labels(outcome="lost").inc(len(lost))
        log.error(
            "lease lost on %d delivery(ies) (a peer may run them): they will not run or be acknowledged here", len(lost)
        )
    return lost


class Renewer:
    """The daemon thread renewing this worker's leases every LEASE_SECONDS/3 (and at once after a failure)."""

    def __init__(self, client_factory: Callable[[], Any]) -> None:
        self._client_factory = client_factory
        self._thread = threading.Thread(target=self._run, name="pipeline-lease-renewer", daemon=True)

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def _run(self) -> None:
        period = _lease_seconds / 3
        client: Any = None
        while True:  # a daemon thread: it renews as long as the worker process lives
            delay = period
            try:
                client = client or self._client_factory()
                renew_once(client)
                _renewed(True)
                delay = min(period, 1.0) if has_pending() else period
            except Exception as exc:  # noqa: BLE001  # a connection error, Redis loading its AOF: try again soon
                if _renewed_at is not None:
                    log.warning("lease renewal failed (%r); retrying every second", exc)
                _renewed(False)
                client = None
                delay = 1.0
            _wake.wait(delay)
            _wake.clear()
