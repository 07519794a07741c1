"""What kombu's Redis transport would write for a publish, recorded instead of sent: kombu 5.7's batch hook.

kombu 5.7's `Producer.publish` hands each message to the batch in the producer's per-thread slot
(`Producer._batch_local.current`, which `Producer.batch()` fills) when there is one, and the Redis channel routes
the message and hands that batch its final Redis commands (`Channel._put(..., _publish_batch=batch)` calls
`batch.add("lpush", key, envelope)`; a `task-sent` event's fanout adds a `publish`). `record` puts a recorder in
that slot, so each envelope is byte for byte kombu's own (routing, priority, serialization and body encoding
included) and nothing is sent. `pipeline.publish.capture` builds on it: parking a delayed job and the producer's
message templates (`pipeline.producer`).

The producer writes these envelopes itself, so the API and the CLI refuse to start on a Celery, kombu or redis-py
this was not verified on (`pipeline.compat.PRODUCER_LIBRARIES`, `pipeline.compat.versions.require`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: One Redis command of a publish: its name ("lpush", "publish", "pexpire") and arguments.
Command = tuple[str, tuple[Any, ...]]


@dataclass
class _Recorder:
    """Stands in for a kombu publish batch: the Redis transport routes the message and hands this object
    its final Redis commands (``add("lpush", key, envelope)``), which are recorded instead of sent."""

    commands: list[Command] = field(default_factory=list)

    def publish(self, channel: Any, message: Any, **kwargs: Any) -> None:
        channel.basic_publish(message, _publish_batch=self, **kwargs)

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))


def record(producer: Any, sends: Iterable[Callable[[Any], Any]]) -> list[list[Command]]:
    """The Redis commands each `send(producer)` would run, in order, recorded on `producer` without sending."""
    recorded = []
    slot = producer._batch_local
    previous = getattr(slot, "current", None)
    try:
        for send in sends:
            recorder = slot.current = _Recorder()
            send(producer)
            recorded.append(recorder.commands)
    finally:
        slot.current = previous
        if previous is None:
            del slot.current
    return recorded
