"""Where the coroutine of an `async def` task runs, whatever runs the task.

A typed task's function may be `async def` (`webhooks.deliver`, `email.send`). Celery's tracer, which calls it, is
synchronous, so the coroutine the function returns is handed on by `resolve`:

* in the I/O worker's asyncio pool (`pipeline.runtime.asyncpool`) each async job's trace runs in a `JobGreenlet`:
  `resolve` switches back to the worker, which has the process's asyncio loop await the coroutine among every other
  job's (time limits and cancels apply there) and switches into the greenlet again with its result or exception;
* anywhere else (a solo or prefork worker, a script calling the task), on an event loop of the calling thread's own,
  kept for that thread's next job, so the pooled clients of `per_loop` stay open between jobs: one job at a time.

`per_loop(key, factory)` is how a task keeps one pooled client (HTTP, SMTP) per event loop: made on first use in a
loop, closed by `close_loop_resources` when the loop's owner shuts down (the asyncio pool at worker stop; a thread's
own loop at interpreter exit).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet  # type: ignore[import-untyped]  # no stubs are published

T = TypeVar("T")

_local = threading.local()
#: Per event loop: key -> (resource, async closer).
_resources: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, tuple[Any, Callable[[], Awaitable[Any]]]]]
_resources = weakref.WeakKeyDictionary()
_runners: list[asyncio.Runner] = []
_runners_lock = threading.Lock()


class JobGreenlet(greenlet):  # type: ignore[misc]  # greenlet's class is untyped for subclassing
    """An async job of the asyncio pool: its trace runs here; its coroutine is awaited on the pool's loop."""


def in_job() -> bool:
    """Whether this is an async job's greenlet of the asyncio pool (other jobs interleave with it)."""
    return isinstance(getcurrent(), JobGreenlet)


def resolve(value: Any) -> Any:
    """`value`, or, for a coroutine, what it returns once awaited (see the module doc); its exception is raised."""
    if not inspect.iscoroutine(value):
        return value
    current = getcurrent()
    if isinstance(current, JobGreenlet):
        return current.parent.switch(value)
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None:
        runner = _local.runner = asyncio.Runner()
        with _runners_lock:
            _runners.append(runner)
    return runner.run(value)


def per_loop(key: str, factory: Callable[[], T], closer: Callable[[T], Awaitable[Any]]) -> T:
    """The resource `key` of the running event loop, made by `factory()` on first use; `closer(resource)` closes it."""
    loop = asyncio.get_running_loop()
    held = _resources.get(loop)
    if held is None:  # `setdefault` would make a weak reference with a callback on every call
        held = _resources[loop] = {}
    entry = held.get(key)
    if entry is None:
        resource = factory()
        entry = held[key] = (resource, lambda: closer(resource))
    return entry[0]


async def close_loop_resources() -> None:
    """Close every `per_loop` resource of the running loop (its owner is shutting down)."""
    held = _resources.pop(asyncio.get_running_loop(), {})
    for _, close in held.values():
        with contextlib.suppress(Exception):  # a client that cannot close cleanly is dropped all the same
            await close()


@atexit.register
def _close_runners() -> None:
    with _runners_lock:
        runners, _runners[:] = list(_runners), []
    for runner in runners:
        with contextlib.suppress(Exception):  # at exit, from another thread's runner: nothing more to do
            runner.run(close_loop_resources())
            runner.close()
