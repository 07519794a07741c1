"""Watches on the queue lists themselves: an idle channel wakes on a message whoever pushed it.

The wake-up markers (`pipeline.queues.wake`) are pushed only by the pipeline's own publishes. Celery's `apply_async`
and `send_task` from a stock app (kombu's plain Redis transport), another language's Celery client, Flower's
task-apply API: each only LPUSHes the message on the queue's list (kombu's `Channel._put`), which a stock worker
sees at once because it waits in BRPOP on those lists. The pipeline's fetch is a script, which cannot block, and a
blocking pop would take a message out of Redis before anything recorded it (a worker dying then loses it).

So while a channel waits, each list key it consumes with acknowledgement (every queue at every priority step,
`queue\\x06\\x16N`; not a paused queue's) has a connection of its own blocked in `BLMOVE k k RIGHT RIGHT <WATCH_S>`:
the list's oldest element moved onto its own tail, which changes nothing and consumes nothing, answered as soon as
`k` holds an element. Every idle worker's watch on `k` answers with the same element; the first to claim it (`SET
NX` on CLAIM_KEY, named by its delivery tag), if the list still holds a message, pushes the queue's wake-up marker,
which wakes one idle worker of the queue as a marker pushed with the message would; the others do nothing more. A
channel whose own wait already has its answer (a marker pushed with the message) claims it without a marker: it
fetches next, and takes it (the oldest on its list). A watch is armed again only when its channel starts its next
wait: one answer per wait at most, none while the channel is busy taking jobs, and a message pushed while no watch
is armed is still on its list when the next watch is armed (which answers at once) or the next fetch comes.

What it costs: one connection per watched key while the worker runs, and per message pushed on a list each idle
worker's watch answers and tries the claim (one round trip), armed again at its next wait; the project's own
enqueue, its markers and the fetch are unchanged. A pipeline publish answers the watches too: its claim goes to one
of them, which pushes a second marker unless it is the worker the publish's marker woke or that worker took the
message already (else one worker fetches for nothing). On a full Redis (`pipeline.delivery.full`) no watch is armed:
BLMOVE is refused there.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from typing import Any, Final

import redis
from kombu.transport import redis as kombu_redis

from pipeline.constants import KEY_PREFIX
from pipeline.queues import wake

log = logging.getLogger(__name__)

#: A message's claim: the first watch that answers with it (SET NX) wakes a worker for it, the others do not. It
#: outlives the message's stay on its list (the next fetch of any idle worker of the queue takes it).
CLAIM_KEY: Final = KEY_PREFIX + "wake-claim:{id}"
CLAIM_TTL_MS: Final = 10_000
#: Where a message envelope's delivery tag sits: near its end (kombu writes `properties` last).
_TAG = re.compile(rb'"delivery_tag"\s*:\s*"([^"]{1,200})"')
_TAIL = 4096
#: How long one watch blocks before it answers nil (seconds); it is armed again at the channel's next wait.
WATCH_S: Final = 60.0
#: The poller's event type of a watch (`MultiChannelPoller._fd_to_chan`), followed by the watched key.
TYPE_PREFIX: Final = "WATCH:"


class Watch:
    """One watched key: its own connection (kombu's poller keys its registrations by this object, as `client`)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.armed = False


class Watches:
    """The watches of one channel (see the module doc)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self._watches: dict[str, Watch] = {}

    def arm(self, keys: list[str]) -> None:
        """Start a watch on each of `keys` that is not watched now."""
        for key in keys:
            watch = self._watches.get(key)
            if watch is None:
                pool = self._channel.async_pool  # its connections leave kombu's poller when they disconnect
                watch = self._watches[key] = Watch(pool.connection_class(**pool.connection_kwargs))
            if watch.armed:
                continue
            try:
                watch.connection.send_command("BLMOVE", key, key, "RIGHT", "RIGHT", f"{WATCH_S:.3f}")
                self._channel.handlers[TYPE_PREFIX + key] = lambda key=key: self.answered(key)
                self._channel.connection.cycle._register(self._channel, watch, TYPE_PREFIX + key)
            except redis.exceptions.ConnectionError as exc:
                log.debug("watch on %r not armed: %s", key, exc)
                self._drop(key, watch)
                continue
            watch.armed = True

    def answered(self, key: str) -> None:
        """A watch's reply is readable: read it. A message there that no other watch claimed wakes a worker: this
        channel, when its wait already has its answer (it fetches next); else the queue's marker."""
        watch = self._watches.get(key)
        if watch is None or not watch.armed:
            return
        watch.armed = False
        try:
            element = watch.connection.read_response()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self._drop(key, watch)  # armed again (reconnected) at the next wait
            return
        except redis.exceptions.ResponseError as exc:  # refused (a full Redis): the markers and the poll go on
            log.debug("watch on %r refused: %s", key, exc)
            return
        answered = self._wait_answered()
        if element is None or answered is None:
            return  # timed out, or the channel is busy: its next fetch, or the watch armed at its next wait, sees it
        try:
            if self._claim(watch, key, element) and not answered:
                self._mark(watch, key)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self._drop(key, watch)  # not heard: the workers' waits end at their fallback poll
        except redis.exceptions.ResponseError as exc:
            log.debug("watch on %r not followed: %s", key, exc)

    def _wait_answered(self) -> bool | None:
        """None when the channel's own connection is not waiting; else whether its wait has its answer already (a
        marker pushed with the message: it fetches next, and takes the message, the oldest on its list)."""
        waiting = self._channel._in_poll if self._channel._waiting else None
        if waiting is None:
            return None
        try:
            return bool(waiting.can_read(timeout=0))
        except (redis.exceptions.ConnectionError, OSError):
            return None  # its reader finds out

    @staticmethod
    def _claim(watch: Watch, key: str, element: bytes | str) -> bool:
        """Claim `element` (SET NX): True for the first watch of any worker that answered with it, while list `key`
        still holds a message (in the same round trip: a worker woken by the marker of a pipeline publish has often
        taken it by then, and no second marker is pushed)."""
        if isinstance(element, str):  # a client decoding replies
            element = element.encode("utf-8", "surrogateescape")
        found = _TAG.search(element, max(0, len(element) - _TAIL))
        ident = found.group(1) if found else hashlib.blake2b(element, digest_size=16).hexdigest().encode()
        claim = CLAIM_KEY.format(id=ident.decode("utf-8", "replace"))
        conn = watch.connection
        conn.send_packed_command(conn.pack_commands([("SET", claim, "1", "NX", "PX", CLAIM_TTL_MS), ("LLEN", key)]))
        won, left = conn.read_response(), conn.read_response()
        return won is not None and int(left) > 0

    @staticmethod
    def _mark(watch: Watch, key: str) -> None:
        """Push the queue's wake-up marker (`pipeline.queues.wake`): it wakes one idle worker of the queue."""
        conn = watch.connection
        name = wake.marker(key)
        conn.send_packed_command(conn.pack_commands([("LPUSH", name, "1"), ("LTRIM", name, 0, wake.WAKE_MAX - 1)]))
        conn.read_response()
        conn.read_response()

    def close(self) -> None:
        """Drop every watch's connection (the channel closes)."""
        watches, self._watches = self._watches, {}
        for key, watch in watches.items():
            self._channel.handlers.pop(TYPE_PREFIX + key, None)
            self._drop(key, watch)

    def _drop(self, key: str, watch: Watch) -> None:
        """Out of the poller, disconnected (kombu's event loop drops a disconnected socket too; its plain poller
        keeps the registration)."""
        watch.armed = False
        cycle = self._channel.connection.cycle if self._channel.connection is not None else None
        sock = cycle._chan_to_sock.pop((self._channel, watch, TYPE_PREFIX + key), None) if cycle else None
        if cycle is not None and sock is not None:
            with contextlib.suppress(Exception):  # a socket closed already: nothing to unregister
                cycle._unregister_from_poll(sock.fileno())  # the event loop's remove_reader, else the poller's
            for fd, registered in list(cycle._fd_to_chan.items()):
                if registered == (self._channel, TYPE_PREFIX + key):
                    del cycle._fd_to_chan[fd]
        watch.connection.disconnect()


def is_watch(event_type: str) -> bool:
    """Whether a poller registration's type is a watch's."""
    return event_type.startswith(TYPE_PREFIX)


class Poller(kombu_redis.MultiChannelPoller):
    """kombu's poller, reading a watch's reply whether or not its channel can consume now (kombu reads a channel's
    socket only while it can: a watch's answer left unread would keep the loop awake)."""

    def on_readable(self, fileno: int) -> None:
        if not self._watch_read(fileno):
            super().on_readable(fileno)

    def handle_event(self, fileno: int, event: int) -> Any:
        """Without an event loop (`drain_events`): a watch's socket, readable or in error, is read by its watch
        (kombu would parse an error on the channel's own connection)."""
        return None if self._watch_read(fileno) else super().handle_event(fileno, event)

    def _watch_read(self, fileno: int) -> bool:
        registered = self._fd_to_chan.get(fileno)  # type: ignore[attr-defined]  # kombu's, untyped
        if registered is None or not is_watch(registered[1]):
            return False
        channel, event_type = registered
        channel.handlers[event_type]()
        return True


class Polled:
    """A transport whose channels share the watch-aware poller (mixed in before kombu's Redis transport)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle: Any = Poller()  # kombu built its own in __init__, before any channel registered with it
