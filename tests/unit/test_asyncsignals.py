"""Deferred shutdown signals (`pipeline.runtime.asyncsignals`): one request per signal while jobs are in flight, and
the handler in place at the safe point is the one that runs."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.runtime.asyncsignals import Deferred


@pytest.fixture
def usr1() -> Iterator[None]:
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_a_signal_sent_twice_before_the_safe_point_runs_its_handler_once(usr1: None) -> None:
    ran: list[int] = []
    nudged: list[bool] = []
    deferred = Deferred(busy=lambda: True, nudge=lambda: nudged.append(True))
    handle = deferred.wrap(lambda signum, frame: ran.append(signum))
    signal.signal(signal.SIGUSR1, handle)
    handle(signal.SIGUSR1, None)
    handle(signal.SIGUSR1, None)  # a supervisor passing on what the whole group was sent
    assert ran == [] and len(nudged) == 1
    deferred.deliver()
    assert ran == [signal.SIGUSR1]


def test_a_handler_replaced_before_the_safe_point_is_not_run_the_current_one_is(usr1: None) -> None:
    ran: list[str] = []
    deferred = Deferred(busy=lambda: True, nudge=lambda: None)
    first = deferred.wrap(lambda signum, frame: ran.append("first"))
    signal.signal(signal.SIGUSR1, first)
    first(signal.SIGUSR1, None)

    def replaced(signum: int, frame: Any) -> None:
        ran.append("replaced")

    signal.signal(signal.SIGUSR1, replaced)  # as a soft shutdown does for a second SIGTERM
    deferred.deliver()
    assert ran == ["replaced"]


def test_with_no_job_in_flight_a_signal_is_handled_at_once() -> None:
    ran: list[int] = []
    deferred = Deferred(busy=lambda: False, nudge=lambda: None)
    deferred.wrap(lambda signum, frame: ran.append(signum))(signal.SIGUSR1, None)
    assert ran == [signal.SIGUSR1] and not deferred.pending
