"""Watches on the queue lists themselves: an idle channel wakes on a message whoever pushed it.

The wake-up markers (`pipeline.queues.wake`) are pushed only by the pipeline's own publishes. Celery's `apply_async`
and `send_task` from a stock app (kombu's plain Redis transport), another language's Celery client, Flower's
task-apply API: each only LPUSHes the message on the queue's list (kombu's `Channel._put`), which a stock worker
sees at once because it waits in BRPOP on those lists. The pipeline's fetch is a script, which cannot block, and a
blocking pop would take a message out of Redis before anything recorded it (a worker dying then loses it).

So while a channel waits, each list key it consumes with acknowledgement (every queue at every priority step,
`queue\\x06\\x16N`; not a paused queue's) has a connection of its own blocked in `BLMOVE k k RIGHT RIGHT <WATCH_S>`:
the list's oldest element moved onto its own tail, which changes nothing and consumes nothing, answered as soon as
`k` holds an element. A watch that answers with an element while the channel's own connection waits (on the markers,
`pipeline.delivery.waking`) and has no answer yet (a marker pushed with the message answers both) rings the
channel's doorbell: `LPUSH` on a list only that channel waits on (the first key
of its marker wait, `DOORBELL_KEY`), so the wait returns and the channel fetches. A doorbell rung before the wait
reached Redis is still heard (CLIENT UNBLOCK would be lost then). A watch is armed again only when its channel starts
a wait and the watch has answered: one answer per wait at most, and none while the channel is busy taking jobs.

What it costs: one connection per watched key while the worker runs; the project's own enqueue, the markers and the
fetch are unchanged. Every idle channel on a queue wakes on a message pushed there, a pipeline publish's too (its
marker wakes one channel, which rings no doorbell): the others find nothing and wait again, one doorbell and one
empty fetch each (docs/leases.md has the measured cost). On a full Redis (`pipeline.delivery.full`) no watch is armed:
BLMOVE is refused there.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any, Final

import redis
from kombu.transport import redis as kombu_redis

from pipeline.constants import KEY_PREFIX

log = logging.getLogger(__name__)

#: The list a channel's doorbell is rung on (its id is fresh per channel); it expires DOORBELL_TTL_MS after a ring.
DOORBELL_KEY: Final = KEY_PREFIX + "doorbell:{id}"
DOORBELL_TTL_MS: Final = 60_000
#: How long one watch blocks before it answers nil (seconds); it is armed again at the channel's next wait.
WATCH_S: Final = 10.0
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
        self.doorbell = DOORBELL_KEY.format(id=uuid.uuid4().hex)
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
        """A watch's reply is readable: read it; an element there while the channel waits rings its doorbell."""
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
        if element is not None and self._waiting_unanswered():
            self.ring(watch)

    def _waiting_unanswered(self) -> bool:
        """Whether the channel's own connection waits and no answer came yet (a push with a marker answers both the
        marker's wait and the list's watch at once: no doorbell then, and no empty fetch after it)."""
        waiting = self._channel._in_poll if self._channel._waiting else None
        if waiting is None:
            return False
        try:
            return not waiting.can_read(timeout=0)
        except (redis.exceptions.ConnectionError, OSError):
            return False  # its reader finds out

    def ring(self, watch: Watch) -> None:
        """Ring the channel's doorbell on `watch`'s connection (free now: its watch answered)."""
        conn = watch.connection
        try:
            conn.send_packed_command(
                conn.pack_commands(
                    [
                        ("LPUSH", self.doorbell, "1"),
                        ("LTRIM", self.doorbell, 0, 0),
                        ("PEXPIRE", self.doorbell, DOORBELL_TTL_MS),
                    ]
                )
            )
            for _ in range(3):
                conn.read_response()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            conn.disconnect()  # not heard: the channel's wait ends at its fallback poll
        except redis.exceptions.ResponseError as exc:
            log.debug("doorbell not rung: %s", exc)

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
