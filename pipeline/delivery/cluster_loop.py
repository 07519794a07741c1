"""The cluster transport on the worker's event loop (kombu's hub): how a worker on a Redis Cluster wakes and fetches
when Celery runs its asynchronous loop (the asyncio pool, prefork, solo).

kombu's Redis transport registers its sockets with the hub and reads the reply of a BRPOP sent at each tick
(`MultiChannelPoller`). A cluster has no one socket to read: a worker's queues live on several masters, and a
blocking command names keys of one slot. So the blocking waits stay where they are, one thread per consumed queue
(`Waiters`: BLMPOP on the queue's wake-up marker, on its master), and what they hear reaches the hub through a
self-pipe (`Wakeups`), a file descriptor it polls:

* at every tick of the loop each channel (`Evented.on_tick`) fetches from the queues it holds *ready* (not found
  empty since they last woke), in rotation from one further each round, as long as its prefetch allows: one
  `fetch.lua` call per queue, as the synchronous loop does (`pipeline.delivery.clustered`). A queue the fetch found
  empty leaves the ready set and its waiter is armed (only while the prefetch has room: a full worker waits on nothing);
* a waiter that pops its queue's marker disarms itself, notes the queue and writes to the pipe; the hub, woken, puts
  the queue back in the ready set, and the next tick fetches it: a job pushed to any master starts at once;
* every `wake_poll_s` (the fallback poll, as on a single Redis) every queue is ready again: a message pushed
  without a marker is found within it;
* Celery's control and events arrive over pub/sub (`pipeline.delivery.cluster_fanout`): the subscription's socket is
  registered with the hub, and each readable event delivers what came.

Acknowledgements, renewals, requeues and the sweep go through the same paths as on the synchronous loop
(`ClusterQoS`; the sweep from the tick, every `unacked_restore_interval`). A connection error raised by a tick's
fetch leaves the hub, and Celery reconnects as it does for kombu's own transport.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pipeline import cluster
from pipeline.delivery import waking
from pipeline.queues import keys

#: How long one waiter thread blocks on its queue's marker before it looks whether it should stop (seconds).
BLOCK_S = 1.0


class Wakeups:
    """A self-pipe the waiter threads write to and the hub polls."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def signal(self) -> None:
        """From any thread: make the pipe readable (a full pipe is readable already)."""
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class Waiters:
    """One thread per queue, blocking on the queue's wake-up marker (on the master serving its slot) while armed.

    A marker popped disarms the queue's thread, notes the queue (`take`), sets `woken` and calls `notify` (the hub's
    `Wakeups.signal`, when the channel is on the event loop)."""

    def __init__(self, errors: tuple[type[BaseException], ...]) -> None:
        self.errors = errors
        self.woken = threading.Event()
        self.notify: Callable[[], None] | None = None
        self._armed: dict[str, threading.Event] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._woke: set[str] = set()

    def arm(self, queues: Iterable[str]) -> None:
        for queue in queues:
            armed = self._armed.get(queue)
            if armed is None:
                armed = self._armed[queue] = threading.Event()
                thread = threading.Thread(target=self._run, args=(queue, armed), daemon=True, name=f"wake-{queue}")
                thread.start()
            armed.set()

    def disarm(self, queues: Iterable[str] | None = None) -> None:
        for queue in self._armed if queues is None else queues:
            if queue in self._armed:
                self._armed[queue].clear()

    def armed(self) -> set[str]:
        return {queue for queue, armed in self._armed.items() if armed.is_set()}

    def take(self) -> set[str]:
        """The queues whose marker was popped since the last call."""
        with self._lock:
            woke, self._woke = self._woke, set()
            self.woken.clear()
        return woke

    def stop(self) -> None:
        self._stop.set()
        for armed in self._armed.values():
            armed.set()  # each thread sees the stop within BLOCK_S

    def _run(self, queue: str, armed: threading.Event) -> None:
        client = cluster.client(BLOCK_S + 5)
        marker = keys.wake(queue, True)
        try:
            while not self._stop.is_set():
                if not armed.wait(BLOCK_S) or self._stop.is_set():
                    continue
                try:
                    popped = client.blmpop(BLOCK_S, 1, marker, direction="RIGHT")
                except self.errors:
                    self._stop.wait(BLOCK_S)
                    continue
                if popped:
                    armed.clear()
                    with self._lock:
                        self._woke.add(queue)
                        self.woken.set()
                    notify = self.notify
                    if notify is not None:
                        notify()
        finally:
            client.close()


def pubsub_fileno(pubsub: Any) -> int | None:
    """The socket of a subscribed redis-py `PubSub` (None before its first subscription or once disconnected)."""
    connection = getattr(pubsub, "connection", None)
    sock = getattr(connection, "_sock", None)
    return None if sock is None else int(sock.fileno())


class Evented:
    """The channel's side of the event loop (mixed into `ClusterChannel`; see the module doc)."""

    waiters: Waiters
    qos: Any
    untracked: set[str]
    paused_queues: set[str]
    _active_queues: list[str]
    closed: bool
    _loop: Any = None
    _pubsub: Any
    _pubsub_fd: int | None = None

    # The channel's (`ClusterChannel`; `_broadcasts` is `Fanout`'s, ahead of this class in its bases).
    def _round(self, queues: list[str]) -> tuple[int, set[str]]:
        raise NotImplementedError

    def _broadcasts(self) -> int:
        raise NotImplementedError

    def _sweep_when_due(self, queues: list[str]) -> None:
        raise NotImplementedError

    def _ready_set(self) -> set[str]:
        """The queues to fetch at the next tick; a queue consumed since the last call is ready."""
        if not hasattr(self, "_ready"):
            self._ready: set[str] = set()
            self._known: set[str] = set()
        consumed = set(self._active_queues)
        self._ready |= consumed - self._known
        self._ready &= consumed
        self._known = consumed
        return self._ready

    def on_tick(self, loop: Any, notify: Callable[[], None]) -> None:
        """A tick of the hub: fetch the ready queues (as the prefetch allows), then arm the waiters of the others."""
        if self.closed:
            return
        self._loop = loop
        self.waiters.notify = notify
        self._watch_broadcasts(loop)
        queues = list(self._active_queues)
        ready = self._ready_set()
        ready |= self.waiters.take()
        self._sweep_when_due(queues)
        if not self.qos.can_consume():
            self.waiters.disarm()
            return
        due = [queue for queue in queues if queue in ready]
        if due:
            _taken, empty = self._round(due)
            ready -= empty
        if self.qos.can_consume():  # a paused queue is not waited on: the fallback poll fetches it, as on one Redis
            watch = {queue for queue in queues if queue not in ready} - self.untracked - self.paused_queues
            self.waiters.arm(watch)
            self.waiters.disarm(self.waiters.armed() - watch)
        else:
            self.waiters.disarm()

    def on_fallback(self) -> None:
        """The fallback poll: every queue is fetched at the next tick (a message pushed without a marker)."""
        self._ready_set().update(self._active_queues)

    def on_woken(self) -> None:
        self._ready_set().update(self.waiters.take())

    def _watch_broadcasts(self, loop: Any) -> None:
        """Register the pub/sub socket (Celery's control and events) with the hub, again when it changed."""
        pubsub = getattr(self, "_pubsub", None)
        fd = pubsub_fileno(pubsub) if pubsub is not None else None
        if fd == self._pubsub_fd:
            return
        if self._pubsub_fd is not None:
            with contextlib.suppress(Exception):  # the hub may have dropped it (a reset)
                loop.remove_reader(self._pubsub_fd)
        self._pubsub_fd = fd
        if fd is not None:
            loop.add_reader(fd, self._broadcasts)

    def leave_loop(self) -> None:
        """At the channel's close: its socket off the hub."""
        if self._loop is not None and self._pubsub_fd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pubsub_fd)
        self._pubsub_fd = None
        self._loop = None


class EventedTransport:
    """The transport's side (mixed into `ClusterTransport`): the self-pipe, the tick and the fallback poll."""

    channels: Any  # kombu virtual Transport's
    _wakeups: Wakeups | None = None
    _hub: Any = None
    _timers: tuple[Any, ...] = ()

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.unregister_from_event_loop(connection, self._hub)  # registered again (a reconnect): once only
        self._hub = loop
        wakeups = self._wakeups = Wakeups()
        loop.add_reader(wakeups.fileno(), self._on_woken)
        loop.on_tick.add(self._on_tick)
        self._timers = (loop.call_repeatedly(float(waking.Waking.wake_poll_s), self._on_fallback),)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        loop = loop or self._hub
        if loop is None:
            return
        loop.on_tick.discard(self._on_tick)
        for timer in self._timers:
            timer.cancel()
        self._timers = ()
        if self._wakeups is not None:
            with contextlib.suppress(Exception):  # the hub may be closed, or reset, already
                loop.remove_reader(self._wakeups.fileno())
            self._wakeups.close()
            self._wakeups = None
        self._hub = None

    def _evented(self) -> list[Evented]:
        return [channel for channel in list(self.channels) if isinstance(channel, Evented) and not channel.closed]

    def _on_tick(self) -> None:
        wakeups, hub = self._wakeups, self._hub
        if wakeups is None or hub is None:
            return
        for channel in self._evented():
            channel.on_tick(hub, wakeups.signal)

    def _on_woken(self) -> None:
        if self._wakeups is not None:
            self._wakeups.drain()
        for channel in self._evented():
            channel.on_woken()

    def _on_fallback(self) -> None:
        for channel in self._evented():
            channel.on_fallback()
