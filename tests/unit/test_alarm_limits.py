"""The solo pool's time-limit guard: both stages fire around a job, and nothing fires between jobs."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from pipeline.runtime.timelimits import AlarmLimits


def _task(hard: float | None, soft: float | None) -> Any:
    conf = SimpleNamespace(task_time_limit=None, task_soft_time_limit=None)
    request = SimpleNamespace(timelimit=(hard, soft))
    return SimpleNamespace(request=request, time_limit=None, soft_time_limit=None, app=SimpleNamespace(conf=conf))


@pytest.fixture
def guard() -> Iterator[AlarmLimits]:
    # pytest-timeout may use SIGALRM too: its handler and timer are put back afterwards.
    previous = signal.getsignal(signal.SIGALRM)
    remaining, _interval = signal.setitimer(signal.ITIMER_REAL, 0)
    limits = AlarmLimits()
    limits.install()
    try:
        yield limits
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if remaining:
            signal.setitimer(signal.ITIMER_REAL, remaining)


def _sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def test_the_soft_then_the_hard_limit_are_raised_in_the_job(guard: AlarmLimits) -> None:
    raised: list[type[BaseException]] = []
    guard.start(_task(hard=0.3, soft=0.1))
    try:
        try:
            _sleep(2)
        except SoftTimeLimitExceeded:
            raised.append(SoftTimeLimitExceeded)
            began = time.monotonic()
            try:
                _sleep(2)  # a job that ignores its soft limit
            except TimeLimitExceeded:
                raised.append(TimeLimitExceeded)
                assert 0.1 <= time.monotonic() - began < 1.5  # the hard limit counts from the job's start
    finally:
        guard.stop()
    assert raised == [SoftTimeLimitExceeded, TimeLimitExceeded]


def test_nothing_fires_after_the_job_ended(guard: AlarmLimits) -> None:
    guard.start(_task(hard=0.2, soft=0.1))
    guard.stop()  # the job ended before its limits
    _sleep(0.3)  # the timer was turned off: no exception here
    os.kill(os.getpid(), signal.SIGALRM)  # a stray signal between jobs is ignored
    _sleep(0.05)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_job_without_limits_arms_nothing(guard: AlarmLimits) -> None:
    guard.start(_task(hard=None, soft=None))
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    guard.stop()


def test_a_guard_installed_off_the_main_thread_never_arms_the_timer(guard: AlarmLimits) -> None:
    elsewhere = AlarmLimits()
    installer = threading.Thread(target=elsewhere.install)
    installer.start()
    installer.join()
    elsewhere.start(_task(hard=0.2, soft=0.1))  # on the main thread, but no handler of its own was installed
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    elsewhere.stop()


class Stop(Exception):
    """What another thread asks to raise in the job."""


def _interrupt_soon(guard: AlarmLimits, within: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(0.05), guard.interrupt(Stop, within)))
    thread.start()
    return thread


def test_an_interrupt_within_a_function_is_raised_while_it_runs(guard: AlarmLimits) -> None:
    """A plain task's stop (`pipeline.runtime.cancels.Interrupter.start_plain`) lands in its function."""

    def job() -> None:
        _sleep(2)

    thread = _interrupt_soon(guard, job.__code__)
    with pytest.raises(Stop):
        job()
    thread.join()


def test_an_interrupt_within_a_function_that_returned_is_dropped(guard: AlarmLimits) -> None:
    """The signal landing after the function returned (in the tracer's code around it) raises nothing there."""

    def job() -> None:
        """Returned before the interrupt."""

    job()
    thread = _interrupt_soon(guard, job.__code__)
    thread.join()
    _sleep(0.2)  # the handler ran here: outside `job`
    assert guard._interrupt is None and guard._within is None
