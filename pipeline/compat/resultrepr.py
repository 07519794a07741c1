"""The worker's text of a job's result: Python's `repr` for plain data, Celery's `saferepr` for anything else.

Celery's tracer computes `saferepr(result, resultrepr_maxsize)` for every job that succeeds, for its success log
line and the `task-succeeded` event, whether or not either is on (`celery/app/trace.py: build_tracer.trace_task`,
which looks the name up in its module each time). Celery's `saferepr` is a generic walker written in Python: 12 µs
for `{'ok': True}` and 39 µs for an email's result on the 2-core machine, 5 % of a solo worker's whole job.

What a typed task returns is plain data (its result model's JSON dump). When a result is made only of str, int,
float, bool, None, lists, tuples and dicts with str keys, no deeper than `saferepr`'s levels, with at most
PLAIN_ITEMS items and a repr within `resultrepr_maxsize`, its text is Python's `repr`: the same text `saferepr`
gives, except that strings are escaped as Python escapes them (`saferepr` writes a newline as it is). Anything
else (other types, a cycle, a deeper, bigger or longer result) goes to Celery's own `saferepr`, unchanged.

`install()` puts it in the tracer's module; the worker calls it before its pool starts (`pipeline.runtime.worker`).
Outside the Celery versions it was verified on (`pipeline.compat.versions`), it leaves Celery's `saferepr` there.
"""

from __future__ import annotations

from typing import Any

from celery.app import trace
from celery.utils.saferepr import saferepr as celery_saferepr

from pipeline import compat

#: Items (scalars and containers) a result may hold and still be written by `repr`.
PLAIN_ITEMS = 256
_SCALARS = frozenset({str, int, float, bool, type(None)})
_SEQUENCES = frozenset({list, tuple})


def _room(value: Any, levels: int, room: int) -> int:
    """`room` less the items of `value`, or -1 when `value` is not plain data within `levels` container levels."""
    room -= 1
    kind = type(value)
    if kind in _SCALARS:
        return room
    if levels <= 0 or room < 0:
        return -1
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return -1
            room = _room(item, levels - 1, room - 1)
            if room < 0:
                return -1
        return room
    if kind in _SEQUENCES:
        for item in value:
            room = _room(item, levels - 1, room)
            if room < 0:
                return -1
        return room
    return -1


def result_repr(o: Any, maxlen: int | None = None, maxlevels: int = 3, seen: Any = None) -> str:
    """`saferepr(o, maxlen, maxlevels, seen)`, by Python's `repr` when `o` is plain data (see the module doc)."""
    if seen is None and _room(o, maxlevels, PLAIN_ITEMS) >= 0:
        try:
            text = repr(o)
        except ValueError:  # an int over Python's digit limit: Celery's walker says what it says of it
            text = None
        if text is not None and (maxlen is None or len(text) <= maxlen):
            return text
    return str(celery_saferepr(o, maxlen=maxlen, maxlevels=maxlevels, seen=seen))


def install() -> None:
    """The tracer writes results with `result_repr` (idempotent); not on an unverified Celery."""
    if compat.enabled(__name__):
        trace.saferepr = result_repr  # type: ignore[attr-defined]  # the tracer's module global, looked up per job
