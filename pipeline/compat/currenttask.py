"""Celery's current-task stack (`celery.current_task`), for a job whose function runs on another thread than its
trace (`pipeline.runtime.plainjobs`): the tracer pushes the task on the stack of its own thread (greenlet), and the
function's thread has a stack of its own (`celery.utils.threads.LocalStack`). Celery names no public way to push on
it; its own `Task.__call__` and tracer use `celery._state.push_current_task`/`pop_current_task` (`_task_stack`).

Outside the Celery versions this was verified on (`pipeline.compat.versions`) nothing is pushed: `current_task` is
then None in such a job (its `self.request`, pushed through the task's public `request_stack`, is unaffected).
"""

from __future__ import annotations

from typing import Any

from celery import _state

from pipeline import compat


def push(task: Any) -> None:
    """`task` is this thread's current task (`celery.current_task`) until `pop`."""
    if compat.enabled(__name__):
        _state.push_current_task(task)  # type: ignore[attr-defined]  # untyped in celery-types


def pop() -> None:
    if compat.enabled(__name__):
        _state.pop_current_task()  # type: ignore[attr-defined]  # untyped in celery-types
