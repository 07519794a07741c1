"""Every queue the app routes to, in one place: what visits each queue's keys on a Redis Cluster walks this.

On a Redis Cluster each queue keeps its keys in a slot of its own (`pipeline.queues.keys`), so a loop over every
queue's keys (the delayed-job releaser, the parked-job reads of `pipeline status` and the exporter, a cancel of a job
whose queue is not known) makes one call per queue. The queues are:

* the work queues (`WORK_QUEUES`) and those ROUTES names;
* the queue each registered task routes to: its own `queue` option (`typed_task(..., queue="x")`, or Celery's
  `@app.task(queue="x")`), else its route;
* the queues the app declares, which in a worker include those it consumes (`-Q`, `add_consumer`: Celery adds a queue
  it was not told of to the app's queues).

A queue of none of these (a job sent by hand to a queue no task names and no worker here consumes) is not walked by
this process; a worker consuming it walks it. A name a cluster refuses (one holding `{` or `}`: `keys.tag`) is left
out: no key of it exists there (its enqueue fails), and one such name must not stop the walk of the others. On a
single Redis every queue shares the keys these loops read, and they do not ask.

`job_queues` is the same less the dead-letter queue (no worker consumes it): the queues `pipeline queues`,
`GET /queues`, the exporter and the job browser show, and the ones that can be paused; `known_queue` refuses a name
that is none of them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from pipeline.constants import DEAD_LETTER_QUEUE, ROUTES, WORK_QUEUES
from pipeline.queues import keys

if TYPE_CHECKING:
    from celery import Celery

_lock = threading.Lock()
#: (app, how many tasks and queues it had, the answer): kept while the app registers no task and declares no queue.
_known: list[tuple[Celery, tuple[int, int], tuple[str, ...]]] = []


def routed_queues(app: Celery) -> tuple[str, ...]:
    """Every queue `app` (the process's: `pipeline.celery_app.get_app()`) routes to or consumes, work queues first
    (see the module doc)."""
    size = (len(app.tasks), len(app.amqp.queues))
    with _lock:
        if _known and _known[0][0] is app and _known[0][1] == size:
            return _known[0][2]
    found = _routed(app)
    with _lock:
        # routing a task may declare its queue (Celery creates a missing queue): keep the size after the walk
        _known[:] = [(app, (len(app.tasks), len(app.amqp.queues)), found)]
    return found


class UnknownQueue(LookupError):
    """No queue the app routes to has this name."""


def job_queues(app: Celery) -> tuple[str, ...]:
    """`routed_queues(app)` less the dead-letter queue: every queue whose jobs a worker of `app` starts."""
    return tuple(name for name in routed_queues(app) if name != DEAD_LETTER_QUEUE)


def known_queue(app: Celery, queue: str) -> str:
    """`queue` if it is one of `job_queues(app)`, else `UnknownQueue` naming them."""
    known = job_queues(app)
    if queue in known:
        return queue
    raise UnknownQueue(f"no queue {queue!r} the app routes to; one of {', '.join(known)}")


def _routed(app: Celery) -> tuple[str, ...]:
    found = dict.fromkeys([*WORK_QUEUES, *ROUTES.values()])
    router = app.amqp.router
    for name, task in list(app.tasks.items()):
        own = getattr(task, "queue", None)
        found[str(router.route({"queue": own} if own else {}, name)["queue"].name)] = None
    found.update(dict.fromkeys(str(name) for name in list(app.amqp.queues)))
    return tuple(name for name in found if _taggable(name))


def _taggable(name: str) -> bool:
    try:
        keys.tag(name)
    except ValueError:
        return False
    return True
