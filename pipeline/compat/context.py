"""Celery's task `Context`, built for every job: its custom headers found without rebuilding Celery's key set.

The tracer builds a `Context` from the request (`celery/app/trace.py`); when the message carries no `headers`
entry, `Context.__init__` calls `_get_custom_headers`, which rebuilds the set of Celery's own keys from
`Context.__dict__` (about 60) and pops each from a copy of the request, on every job (celery/celery#10212, closed
unmerged). `install` replaces that method with one that keeps the key set until `Context`'s class attributes change
(their number, read in O(1), is the cache key: attributes are added, never renamed) and returns the same headers:
every key of the request that is not Celery's, in the request's order, or None when there is none.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

#: Keys of a request that are Celery's, besides `Context`'s attributes (`Context._get_custom_headers`, 5.7).
_MORE_KEYS = ("lang", "task", "argsrepr", "kwargsrepr", "compression")
_keys: tuple[int, frozenset[str]] = (-1, frozenset())


def celery_keys() -> frozenset[str]:
    """Celery's own request keys, as `Context._get_custom_headers` computes them."""
    global _keys
    size = len(Context.__dict__)
    if _keys[0] != size:
        _keys = (size, frozenset({*Context.__dict__.keys(), *_MORE_KEYS}))
    return _keys[1]


def custom_headers(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    headers: dict[str, Any] = {}
    headers.update(*args, **kwargs)
    keys = celery_keys()
    return {key: value for key, value in headers.items() if key not in keys} or None


#: Celery's own method, kept for tests and `uninstall`.
CELERY_CUSTOM_HEADERS = Context._get_custom_headers  # type: ignore[attr-defined]  # untyped in celery-types


def install() -> None:
    Context._get_custom_headers = custom_headers  # type: ignore[attr-defined]  # untyped in celery-types


def uninstall() -> None:
    Context._get_custom_headers = CELERY_CUSTOM_HEADERS  # type: ignore[attr-defined]  # untyped in celery-types
