"""Whether a task event sent now would be published: Celery's dispatcher's group filter, asked before the event is
built.

`EventDispatcher.send` drops an event whose group (`task` for `task-received`, `task-started`...) it does not send,
after its caller has built the event's fields (`celery/events/dispatcher.py: EventDispatcher.send`). A worker's task
events are off until Flower asks for them (`pipeline.runtime.events`), so on that path the fields of every job's
events are built for nothing. `task_events_on` answers the dispatcher's own question first, so the solo worker's
direct path (`pipeline.compat.strategy`) and the worker's request class (`pipeline.delivery`) build an event only
when it would be sent.

Outside the Celery versions it was verified on (`pipeline.compat.versions`), the group filter is not trusted:
`task_events_on` is then true whenever the dispatcher is on, and the dispatcher decides, as in Celery.
"""

from __future__ import annotations

from typing import Any

from pipeline import compat

_verified: list[bool] = []  # `compat.enabled`, read on the first event that the group filter would drop


def task_events_on(eventer: Any) -> bool:
    """A task event sent now through `eventer` would be published: the dispatcher is on and sends the `task` group
    (or, on an unverified Celery, the dispatcher is on)."""
    if eventer is None or not eventer.enabled:
        return False
    groups = eventer.groups
    if not groups or "task" in groups:
        return True
    if not _verified:
        _verified.append(compat.enabled(__name__))
    return not _verified[0]
