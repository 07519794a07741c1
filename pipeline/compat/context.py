"""Celery's task `Context`, built for every job: its custom headers found without rebuilding Celery's key set.

The tracer builds a `Context` from the request (`celery/app/trace.py`); when the message carries no `headers`
entry, `Context.__init__` calls `_get_custom_headers`, which rebuilds the set of Celery's own keys (`Context`'s
attributes, about 60, and a few more it names) and pops each from a copy of the request, on every job
(celery/celery#10212, closed unmerged). `install` replaces that method with one that returns the same headers
(every key of the request that is not Celery's, in the request's order, or None when there is none) and asks
Celery's own method which keys are Celery's: once per key name, with a request holding that key alone, keeping
the answer. No list of Celery's keys is copied here, so a key a newer Celery adds is Celery's here too. The
answers, and which keys of a request of a given shape (its key names in order) are custom, are kept until
`Context`'s class attributes change (their number, read in O(1), is checked on every call: attributes are added,
never renamed) and are dropped when more than `MAX_KEYS` names or shapes were seen (a producer sending ever new
header names cannot grow them without bound).

Outside the Celery versions this was verified on (`pipeline.compat.versions`), `install` leaves Celery's method in
place.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

from pipeline import compat

#: Most key names whose answer is kept.
MAX_KEYS = 4096
#: Celery's own method, kept for tests and `uninstall`.
CELERY_CUSTOM_HEADERS = Context._get_custom_headers  # type: ignore[attr-defined]  # untyped in celery-types

_answers: dict[str, bool] = {}  # key name -> True when Celery keeps it as a custom header
_shapes: dict[tuple[str, ...], tuple[str, ...]] = {}  # a request's keys, in order -> its custom ones
_size = [-1]  # len(Context.__dict__) when the answers were started


def _kept() -> tuple[dict[str, bool], dict[tuple[str, ...], tuple[str, ...]]]:
    size = len(Context.__dict__)
    if _size[0] != size or len(_answers) > MAX_KEYS or len(_shapes) > MAX_KEYS:
        _answers.clear()
        _shapes.clear()
        _size[0] = size
    return _answers, _shapes


def _custom(self: Any, names: tuple[str, ...], answers: dict[str, bool]) -> tuple[str, ...]:
    """The names among `names` Celery keeps as custom headers, asking Celery once per name."""
    custom = []
    for key in names:
        keep = answers.get(key)
        if keep is None:
            keep = answers[key] = CELERY_CUSTOM_HEADERS(self, {key: None}) is not None
        if keep:
            custom.append(key)
    return tuple(custom)


def custom_headers(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """What `Context._get_custom_headers(self, *args, **kwargs)` returns. Requests of one task have the same keys
    in the same order: their custom ones are found once per such shape."""
    headers: dict[str, Any] = {}
    headers.update(*args, **kwargs)
    answers, shapes = _kept()
    names = tuple(headers)
    custom = shapes.get(names)
    if custom is None:
        custom = shapes[names] = _custom(self, names, answers)
    return {key: headers[key] for key in custom} or None


def install() -> None:
    """`Context` finds its custom headers with `custom_headers` (idempotent); not on an unverified Celery."""
    if compat.enabled(__name__):
        Context._get_custom_headers = custom_headers  # type: ignore[attr-defined]  # untyped in celery-types


def uninstall() -> None:
    Context._get_custom_headers = CELERY_CUSTOM_HEADERS  # type: ignore[attr-defined]  # untyped in celery-types
