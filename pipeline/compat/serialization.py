"""kombu's JSON decoding (`kombu.utils.json.loads`), without its per-object hook where no object can need it.

kombu decodes every JSON object through a Python `object_hook` that turns `{"__type__": ..., "__value__": ...}`
back into a datetime, UUID, Decimal or bytes. A worker decodes each message twice (the envelope, then the body),
each with several objects, so the hook runs about eight times per job. An object with the key `__type__` can only
come from text that holds `"__type__"` literally or writes a key with a `\\u` escape; text with neither decodes to
the same value with the standard decoder alone. `loads` checks that and otherwise calls kombu's.

`install` (the worker's runtime) makes it kombu's decoder of `application/json` in the worker process (the
encoder stays kombu's), so Celery's decoding of message bodies uses it too; the worker's check of popped queue
elements (`pipeline.dlq.elements`) takes its decoder from `decoder()`. Outside the kombu versions this was verified
on (`pipeline.compat.versions`), both keep kombu's own `loads`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

from kombu import serialization as kombu_serialization
from kombu.utils import json as kombu_json

from pipeline import compat


def loads(s: Any) -> Any:
    """What `kombu.utils.json.loads(s)` returns."""
    if isinstance(s, memoryview):
        s = s.tobytes().decode("utf-8")
    elif isinstance(s, bytes | bytearray):
        s = s.decode("utf-8")
    if '"__type__"' in s or "\\u" in s:
        return kombu_json.loads(s)
    return json.loads(s)


@cache
def decoder() -> Callable[[Any], Any]:
    """`loads`, or kombu's own on an unverified kombu (decided once per process)."""
    return loads if compat.enabled(__name__) else kombu_json.loads


def install() -> None:
    """kombu's registry decodes `application/json` with `decoder()` (idempotent)."""
    kombu_serialization.register(
        "json", kombu_json.dumps, decoder(), content_type="application/json", content_encoding="utf-8"
    )


def uninstall() -> None:
    kombu_serialization.register(
        "json", kombu_json.dumps, kombu_json.loads, content_type="application/json", content_encoding="utf-8"
    )
