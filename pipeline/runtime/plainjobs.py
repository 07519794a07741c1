"""Where the asyncio pool's plain (sync) jobs run: their function on a bounded set of daemon threads, their trace in
the worker's main thread (`pipeline.runtime.asyncpool`).

A plain job is traced in a `PlainGreenlet`, exactly as an async job is (signals, the result, the acknowledgement,
its limits and stops all go through the pool). Its function does not run there: `install` wraps the `run` of each
plain task of the app (an attribute of the task object, set before Celery's consumer builds the task's tracer, which
calls `task.run`), and inside a plain job's greenlet the wrapper hands the pool a `Call` instead of running it. The
pool has one of WORKER_PLAIN_THREADS threads (`Threads`) run it and awaits the call's future on its loop as it awaits
an async job's coroutine, then switches back into the greenlet with the outcome. Called anywhere else (a direct call
from another task, a script, a thread of the job's own), the wrapper runs the function in place.

On its thread the function sees its job's request (`task.request`: the tracer's own `Context`, pushed on the task's
request stack there, so what the job sets on it is what the tracer reads after) and `celery.current_task`
(`pipeline.compat.currenttask`). A call waits for a free thread in order; its limits start when its thread starts it.

A stop (a time limit, a cancel, a lost lease, a shutdown's give back) raises its exception in the call's thread as
an asynchronous exception (`PyThreadState_SetAsyncExc`, as `pipeline.runtime.cancels` does for an embedded solo
worker): at the function's next Python instruction, so a blocking call in C (`time.sleep`, a socket read) is not
interrupted; the exception is raised when it returns. A call stopped while it waits for a thread ends at once and
never runs. One raised just as the function ended is forgotten (it must not hit the thread's next call).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from greenlet import getcurrent  # type: ignore[import-untyped]  # no stubs are published

from pipeline.compat import currenttask
from pipeline.pools import aio
from pipeline.runtime.cancels import _async_raise

#: The states of a `Call`.
WAITING, RUNNING, ENDED = "waiting", "running", "ended"
_UNSET = object()


class PlainGreenlet(aio.JobGreenlet):
    """A plain job of the asyncio pool: its trace runs here; its function on one of the pool's threads."""

    handed = False  #: its function was handed to the pool (once: a task it calls directly runs in place)


class Call:
    """One plain job's function, to be run on a thread; its outcome lands in `future`, on the pool's loop."""

    def __init__(self, fn: Callable[[], Any], loop: Any) -> None:
        self.fn = fn
        self.loop = loop
        self.future = loop.create_future()
        #: Called on the loop, with the monotonic time, when a thread starts the function after a wait for one.
        self.on_begin: Callable[[float], None] = _nothing
        self.waited = False  #: it waited for a free thread (set by `Threads.submit`)
        self._lock = threading.Lock()
        self._state = WAITING
        self._thread = 0
        self._raised: set[type[BaseException]] = set()

    def interrupt(self, exc: type[BaseException]) -> None:
        """From any thread: raise `exc` in the function if it runs now (at its next Python instruction), once per
        exception type (a stop made again, from the loop, does not interrupt the job's clean-up)."""
        with self._lock:
            if self._state == RUNNING and exc not in self._raised:
                self._raised.add(exc)
                _async_raise(self._thread, exc)

    def stop(self, exc: type[BaseException]) -> None:
        """On the loop: `interrupt`; a call still waiting for a thread ends now with `exc`, unstarted."""
        self.interrupt(exc)
        with self._lock:
            state = self._state
            if state == WAITING:
                self._state = ENDED
        if state == WAITING and not self.future.done():
            self.future.set_exception(exc())

    def run(self) -> tuple[bool, Any] | None:
        """On a thread: (True, what the function returned) or (False, what it raised); None when stopped first."""
        with self._lock:
            if self._state != WAITING:
                return None
            self._state, self._thread = RUNNING, threading.get_ident()
        if self.waited:
            _threadsafe(self.loop, self.on_begin, time.monotonic())
        try:
            return (True, self.fn())
        except BaseException as exc:  # noqa: BLE001  # the job's own exception, or a stop: raised in its trace
            return (False, exc)

    def end(self) -> None:
        """On its thread, after `run`: no stop is raised in it any more, and one not raised yet is forgotten."""
        with self._lock:
            if self._state == RUNNING:
                self._state = ENDED
                _async_raise(self._thread, None)

    def settle(self, ok: bool, value: Any) -> None:
        """On the loop: the call's outcome."""
        if self.future.done():
            return
        if ok:
            self.future.set_result(value)
        elif isinstance(value, StopIteration):  # a future refuses it (it would end a generator): raised as Python would
            self.future.set_exception(RuntimeError(f"the job raised StopIteration: {value!r}"))
        else:
            self.future.set_exception(value)


class Threads:
    """At most `size` daemon threads running `Call`s, started as they are needed; calls beyond wait, in order.
    Daemon threads: a process recycled with a thread still in a job it ignored its stop in can exit."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._calls: collections.deque[Call] = collections.deque()
        self._ready = threading.Condition()
        self._threads = 0
        self._idle = 0

    def submit(self, call: Call) -> bool:
        """Run `call` on a free thread; False when it waits for one (its `on_begin` is called when one starts it)."""
        with self._ready:
            if self._idle > len(self._calls):
                self._ready.notify()
            elif self._threads < self.size:
                self._threads += 1
                name = f"pipeline-plain-{self._threads}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
            else:
                call.waited = True
            self._calls.append(call)
            return not call.waited

    def _next(self) -> Call:
        with self._ready:
            while not self._calls:
                self._idle += 1
                try:
                    self._ready.wait()
                finally:
                    self._idle -= 1
            return self._calls.popleft()

    def _work(self) -> None:
        while True:
            call = self._next()
            outcome: Any = _UNSET
            while True:  # a stop landing here, around the call (it just ended), is caught, and forgotten by `end`
                try:
                    if outcome is _UNSET:
                        outcome = call.run()
                    call.end()
                    break
                except BaseException as exc:  # noqa: BLE001
                    if outcome is _UNSET:
                        outcome = (False, exc)
            if outcome is not None:  # None: stopped while it waited (it ended then)
                _threadsafe(call.loop, call.settle, *outcome)


def install(app: Celery) -> None:
    """Each plain task of `app` hands its function to the pool inside a plain job's greenlet (see the module doc)."""
    for task in app.tasks.values():
        if not getattr(task, "is_async", False) and not getattr(task.run, "handed_to_the_pool", False):
            task.run = _handing(task, task.run)  # type: ignore[method-assign]  # on this task object only


def _handing(task: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    def handed(*args: Any, **kwargs: Any) -> Any:
        current = getcurrent()
        if not isinstance(current, PlainGreenlet) or current.handed:
            return run(*args, **kwargs)
        current.handed = True
        request = task.request  # the tracer's Context for this job

        def call() -> Any:
            task.request_stack.push(request)
            currenttask.push(task)
            try:
                return run(*args, **kwargs)
            finally:
                currenttask.pop()
                task.request_stack.pop()

        return current.parent.switch(call)

    handed.handed_to_the_pool = True  # type: ignore[attr-defined]  # a marker: `install` wraps a task once
    handed.__wrapped__ = run  # type: ignore[attr-defined]  # as functools.wraps: what inspect and Celery look at
    return handed


def _threadsafe(loop: Any, callback: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed (the process stopping): nobody waits for it any more
        loop.call_soon_threadsafe(callback, *args)


def _nothing(_: float) -> None:
    """No-op `on_begin`."""
