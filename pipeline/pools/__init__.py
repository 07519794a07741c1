"""Which Celery pool runs the jobs: one answer for the modules that behave differently per pool.

The asyncio pool (`pipeline.runtime.asyncpool`, the I/O profile) keeps many jobs in flight in one process. The solo
pool runs each job in the worker's main thread (time limits from a timer there, the result carried by
the acknowledging call, a shutdown that cannot wait for the job); prefork runs them in child processes (metrics in
multiprocess mode). Celery names a pool by a `-P` alias until it resolves the class (`celery/concurrency/__init__.py`).
"""

from __future__ import annotations

from typing import Any

#: Celery's `-P` aliases that name the same pool as another.
_ALIASES = {"processes": "prefork"}
#: The module of each of Celery's pools, by the kind it is.
_MODULES = {
    "celery.concurrency.solo": "solo",
    "celery.concurrency.prefork": "prefork",
    "celery.concurrency.thread": "threads",
    "celery.concurrency.gevent": "gevent",
    "celery.concurrency.eventlet": "eventlet",
    "pipeline.runtime.asyncpool": "asyncio",
}


def pool_kind(pool: Any) -> str:
    """'solo', 'prefork', 'threads', 'gevent', 'eventlet' or 'asyncio' (`pipeline.runtime.asyncpool`) for a `-P`
    alias, a pool class or a pool; 'other' for
    anything else (a custom pool, or none)."""
    if isinstance(pool, str):
        name = _ALIASES.get(pool, pool)
        return name if name in _MODULES.values() else "other"
    cls = pool if isinstance(pool, type) else type(pool)
    return _MODULES.get(cls.__module__, "other")


def is_asyncio(pool: Any) -> bool:
    """Many jobs in flight in one process: async tasks' coroutines on an event loop (`-P custom`)."""
    return pool_kind(pool) == "asyncio"


def traces_in_main_thread(pool: Any) -> bool:
    """Jobs are traced in the worker's main thread (solo; the asyncio pool, each job's trace between its waits: an async
    job's coroutine, a plain job's function on a thread of the pool's)."""
    return pool_kind(pool) in ("solo", "asyncio")


def is_solo(pool: Any) -> bool:
    """Jobs run in the worker's main thread, one at a time (`-P solo`)."""
    return pool_kind(pool) == "solo"
