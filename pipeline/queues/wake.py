"""Wake-up markers: how an idle worker learns at once that one of its queues has a job.

A worker's fetch is a Lua script (`pipeline/lua/fetch.lua`), which cannot block. An idle worker waits instead on
markers: one Redis LIST per queue, `pipeline:wake:<queue>` (the queue's name, whatever its priority sub-queue),
that every publish of the pipeline pushes in the same round trip as its message (enqueue.lua, delayed_release.lua,
a worker's own publishes and restores: `pipeline.delivery.transport`, a job built by Celery:
`pipeline.producer.write`). An idle worker blocks with `BLMPOP` over the markers of all its queues, which pops one
marker: one marker wakes one worker, never all of them (BullMQ's marker key is the model). The woken worker fetches
until its queues are empty before it waits again, so markers left by jobs it took meanwhile only cost an idle
worker one empty fetch each.

A publish pushes one marker per message, and the list is trimmed to WAKE_MAX: markers nobody consumes (a queue no
worker serves) stay bounded, and a burst wakes up to WAKE_MAX idle workers of a queue at once (more pick jobs up at
their fallback poll). A message pushed without a marker (a stock Celery app's
`apply_async`, a foreign client) wakes a waiting worker through its watches on the queue lists
(`pipeline.delivery.watches`); a worker fetches in any case after WAKE_POLL_S seconds without a marker, a wait that
doubles up to WAKE_POLL_MAX_S while it stays idle (the fallback poll).

Celery's control replies (`<oid>.reply.celery.pidbox`) get no marker: no worker waits on them.
"""

from __future__ import annotations

from typing import Any, Final

from pipeline.constants import KEY_PREFIX
from pipeline.queues import keys

#: The marker list of a queue (its name, without kombu's priority suffix).
WAKE_KEY: Final = KEY_PREFIX + "wake:{queue}"
#: Markers kept per queue (the scripts trim to the same number: `enqueue.lua`, `delayed_release.lua`).
WAKE_MAX: Final = 16
#: The longest an idle worker waits for a marker before it fetches anyway (seconds), at first: a message pushed
#: without one, that no watch heard, starts within this.
WAKE_POLL_S: Final = 0.5
#: What that wait grows to while the worker stays idle: doubled after each wait that ended with no marker, back to
#: WAKE_POLL_S at the first marker or job (`pipeline.delivery.waking`).
WAKE_POLL_MAX_S: Final = 5.0
#: Queue names that get no marker: kombu's control-reply queues (a client, not a worker, consumes them).
_SILENT_SUFFIX: Final = ".pidbox"


def queue_of(key: str) -> str:
    """The queue a Redis list key belongs to: `email` for `email` and for its priority sub-queue `email\\x06\\x163`
    (`{email}\\x06\\x163` on a cluster)."""
    return keys.queue_of(key)


def marker(key: str) -> str:
    """The marker list of the queue that list `key` belongs to (`pipeline:wake:<queue>`; `keys.wake`)."""
    return keys.wake(queue_of(key))


def silent(queue: str) -> bool:
    """True for a queue that gets no marker (Celery's control replies)."""
    return queue_of(queue).endswith(_SILENT_SUFFIX)


def mark(pipe: Any, key: str, count: int = 1) -> None:
    """Queue on `pipe` (a redis-py pipeline, in the round trip of the push) `count` markers for the queue of list
    `key`, trimmed to WAKE_MAX; nothing for a silent queue."""
    if silent(key) or count <= 0:
        return
    name = marker(key)
    pipe.lpush(name, *["1"] * min(count, WAKE_MAX))
    pipe.ltrim(name, 0, WAKE_MAX - 1)
