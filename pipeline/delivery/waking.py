"""How a worker's channel waits for work: the transport's side of the wake-up markers (`pipeline.queues.wake`).

Mixed into the worker transport's channel (`pipeline.delivery.transport`) ahead of kombu's. An idle channel (its
last fetch found nothing) waits with one `BLMPOP <timeout> n <markers> RIGHT` over the wake-up markers of the queues
it consumes with acknowledgement: any publish of the pipeline pushes one in the round trip of its message, so a job
on any of them (at any priority step) wakes the channel at once, and a marker wakes one channel only. A message
pushed without a marker (Celery's `apply_async` from a stock app, another language's client, Flower) wakes it through
the watches on the queue lists (`pipeline.delivery.watches`), which push the queue's marker for it. It waits at most
`wake_poll_s` (WAKE_POLL_S) in any case; WAIT_MIN_S while it also consumes a queue without acknowledgement (Celery's
control replies, which get no marker). A channel consuming only such queues waits
as before markers: `BLMOVE k k RIGHT RIGHT <timeout>` (a list's last element moved onto itself: no change, awake as
soon as `k` has one), on its one queue for `brpop_timeout`, on several in turn, WAIT_MIN_S doubling to WAIT_MAX_S.
On a full Redis (`pipeline.delivery.full`) it waits with BRPOP on a key nothing writes instead (BLMOVE is refused
there, and so is every publish), and arms no watch.

What the channel publishes and restores carries markers too (`pipeline.compat.marking`).
"""

from __future__ import annotations

from typing import Any

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

    def _wait_command(self: Any, queues: list[str], timeout: float | None) -> list[Any]:
        """The command an idle channel consuming `queues` (kombu's order) waits with. A paused queue's markers are
        not waited on (they would wake it to a fetch that takes nothing); `resume` pushes the queue's marker
        (`pipeline.scheduling.pause`), and the fallback poll bounds the wait in any case."""
        tracked = [queue for queue in queues if queue not in self.untracked]
        paused = getattr(self, "paused", None) or ()
        awake = [queue for queue in tracked if queue not in paused]
        if tracked:
            wait = float(self.wake_poll_s) if len(tracked) == len(queues) else WAIT_MIN_S
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
