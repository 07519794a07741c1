"""How a worker's channel waits for work: the transport's side of the wake-up markers (`pipeline.queues.wake`).

Mixed into the worker transport's channel (`pipeline.delivery.transport`) ahead of kombu's. An idle channel (its
last fetch found nothing) waits with one `BLMPOP <timeout> n <markers> RIGHT` over the wake-up markers of the queues
it consumes with acknowledgement: any publish of the pipeline pushes one in the round trip of its message, so a job
on any of them (at any priority step) wakes the channel at once, and a marker wakes one channel only. A message
pushed without a marker (Celery's `apply_async` from a stock app, another language's client, Flower) wakes it through
the watches on the queue lists (`pipeline.delivery.watches`), which push the queue's marker for it. It waits at most
`wake_poll_s` (WAKE_POLL_S) in any case, the fallback poll, for a message no watch heard (one that could not be armed);
while it stays idle that wait doubles after each one that ended with no marker, up to WAKE_POLL_MAX_S, and is back to
`wake_poll_s` at the first marker or job (a marker or a watch wakes it at once either way); not while a consumed
queue is paused (its resume pushes a marker the channel does not wait on) or Redis is full. WAIT_MIN_S while it also
consumes a queue without acknowledgement (Celery's control replies, which get no marker). A channel consuming only
such queues waits as before markers: `BLMOVE k k RIGHT RIGHT <timeout>` (a list's last element moved onto itself: no
change, awake as soon as `k` has one), on its one queue for `brpop_timeout`, on several in turn, WAIT_MIN_S doubling
to WAIT_MAX_S.
On a full Redis (`pipeline.delivery.full`) it waits with BRPOP on a key nothing writes instead (BLMOVE is refused
there, and so is every publish), and arms no watch.

What the channel publishes and restores carries markers too (`pipeline.compat.marking`).
"""

from __future__ import annotations

from typing import Any

import redis

from pipeline.delivery import full
from pipeline.queues import wake

#: Bounds of the wait on one key of a channel consuming only queues without markers (control replies; seconds).
WAIT_MIN_S = 0.05
WAIT_MAX_S = 0.1


class Waking:
    """The channel's wait (mixed in before kombu's Redis channel)."""

    #: The longest an idle channel waits for a marker before it fetches anyway (seconds).
    wake_poll_s = wake.WAKE_POLL_S
    _wait_s = WAIT_MIN_S
    _wait_turn = 0
    #: Waits in a row that ended with no marker, no job fetched since: the fallback poll backs off by them.
    _idle_waits = 0

    def fallback_poll_s(self: Any) -> float:
        """How long the next wait for a marker lasts at most (see the module doc)."""
        base = float(self.wake_poll_s)
        if getattr(self, "paused", None) or full.waiting(self):
            return base
        return min(max(base, wake.WAKE_POLL_MAX_S), base * 2.0 ** min(int(self._idle_waits), 16))

    def end_wait(self: Any) -> None:
        """At the channel's close, a wait in flight: its reply when it comes within WAKE_POLL_S (a marker it popped is
        read, as before the backoff), else its connection is dropped, which ends the wait in Redis (so a close takes
        no longer than before; a marker popped in that instant is lost, a hint only: the job stays on its list)."""
        conn = self._in_poll
        if conn is None or not self._waiting:
            return
        try:
            ready = conn.can_read(timeout=wake.WAKE_POLL_S)
        except (redis.exceptions.ConnectionError, OSError):
            ready = False
        if not ready:
            self._in_poll = None
            conn.disconnect()

    def waited(self: Any, reply: Any) -> None:
        """A wait's reply (None: it timed out, no marker): the next fallback poll backs off, or starts over."""
        self._idle_waits = self._idle_waits + 1 if reply is None else 0

    def _wait_command(self: Any, queues: list[str], timeout: float | None) -> list[Any]:
        """The command an idle channel consuming `queues` (kombu's order) waits with. A paused queue's markers are
        not waited on (they would wake it to a fetch that takes nothing); `resume` pushes the queue's marker
        (`pipeline.scheduling.pause`), and the fallback poll bounds the wait in any case."""
        tracked = [queue for queue in queues if queue not in self.untracked]
        paused = getattr(self, "paused", None) or ()
        awake = [queue for queue in tracked if queue not in paused]
        if tracked:
            wait = self.fallback_poll_s() if len(tracked) == len(queues) else WAIT_MIN_S
            markers = [wake.marker(queue) for queue in awake] or [full.WAIT_KEY]  # all paused: a key nothing writes
            if not full.waiting(self):  # the lists themselves, for a message pushed without a marker
                self.watches.arm([self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in awake])
            command: list[Any] = ["BLMPOP", f"{wait:.3f}", len(markers), *markers, "RIGHT"]
        else:
            if len(queues) == 1:
                key, wait = queues[0], float(timeout or self.brpop_timeout or 1)
            else:
                self._wait_turn = (self._wait_turn + 1) % len(queues)
                key, wait = queues[self._wait_turn], self._wait_s
                self._wait_s = min(WAIT_MAX_S, self._wait_s * 2)
            command = ["BLMOVE", key, key, "RIGHT", "RIGHT", f"{wait:.3f}"]
        if full.waiting(self):
            command = ["BRPOP", full.WAIT_KEY, f"{wait:.3f}"]
        return command
