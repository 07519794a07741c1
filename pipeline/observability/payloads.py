"""No payload in logs: Celery's log records that carry task arguments, results or message bodies, rewritten.

Celery writes a refused message's whole body (and headers, which hold the arguments' repr) into its
error line for an unregistered task, an invalid or disallowed message and an undecodable body, and a
task's return value into its "succeeded" line. Those records are matched by logger name and message
template and rewritten before any handler sees them (a filter on the logger itself, so the stream
handler and Sentry's logging integration, which becomes an event from an error record, get the same
record): a refused message's body is replaced by the id of its dead-letter entry, the return value is
dropped. `LOG_PAYLOADS=true` keeps Celery's text (plus the entry id). Celery's `data` extra (args,
kwargs, return value, for custom handlers) is always stripped of payloads.

The consumer (`pipeline.dlq.consumer`) dead-letters a refused message first and handles it inside
`refused_message(entry_id)`, which is how the rewritten line learns the entry's id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import import_module
from typing import Any

PAYLOAD_KEYS = frozenset({"args", "kwargs", "return_value", "argsrepr", "kwargsrepr"})
_refused: ContextVar[str | None] = ContextVar("pipeline_refused_message", default=None)
Rewrite = Callable[[logging.LogRecord, str], None]


@contextmanager
def refused_message(entry_id: str | None) -> Iterator[None]:
    """Mark the message being refused in this block as dead-lettered as `entry_id` (None: that failed)."""
    token = _refused.set(entry_id or "")
    try:
        yield
    finally:
        _refused.reset(token)


def refused_entry() -> str | None:
    """Inside `refused_message`: the entry id ("" when dead-lettering failed); None elsewhere."""
    return _refused.get()


def _where() -> str:
    entry = refused_entry()
    if entry is None:
        return "message body not logged (LOG_PAYLOADS=false)"
    if entry == "":
        return "not dead-lettered (see the error above); message body not logged"
    return f"dead-lettered as {entry}"


def _set(record: logging.LogRecord, msg: str, *args: Any) -> None:
    record.msg, record.args = msg, args


def _args(record: logging.LogRecord, n: int) -> tuple[Any, ...]:
    """The record's first `n` positional arguments (padded with None: a template's args always match it)."""
    args = record.args if isinstance(record.args, tuple) else ()
    return (*args[:n], *([None] * (n - len(args[:n]))))


def _unknown_task(record: logging.LogRecord, where: str) -> None:
    _set(record, "Received unregistered task of type %s: discarded, %s", *_args(record, 1), where)


def _unknown_message(record: logging.LogRecord, where: str) -> None:
    _set(record, "Received and deleted unknown message (not a Celery task): %s", where)


def _invalid_task(record: logging.LogRecord, where: str) -> None:
    _set(record, "Received invalid task message: %s: discarded, %s", *_args(record, 1), where)


def _decode_error(record: logging.LogRecord, where: str) -> None:
    exc, content_type, encoding = _args(record, 3)
    error = f"{type(exc).__name__}: {exc}"
    _set(
        record,
        "Can't decode message body: %s [type:%r encoding:%r]: discarded, %s",
        error,
        content_type,
        encoding,
        where,
    )


def _succeeded(record: logging.LogRecord, _: str) -> None:
    context = record.args if isinstance(record.args, dict) else {}
    record.msg = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"
    record.args = {k: v for k, v in context.items() if k not in PAYLOAD_KEYS}


def _succeeded_before_lost(record: logging.LogRecord, _: str) -> None:
    _set(record, "Task %s[%s] succeeded before the worker was lost", *_args(record, 2))


def _bad_eta(record: logging.LogRecord, _: str) -> None:
    eta, exc, info = _args(record, 3)
    task = f"{info.get('name')}[{info.get('id')}]" if isinstance(info, dict) else "?"
    _set(record, "Couldn't convert ETA %r to timestamp: %r. Task: %s", eta, exc, task)


@cache
def _rewrites() -> dict[str, dict[str, tuple[Rewrite, bool]]]:
    """logger name → {Celery's message template → (rewrite, whether it is a refused message's line)}."""
    from celery.app import trace

    consumer: Any = import_module("celery.worker.consumer.consumer")  # its templates are not in celery-types

    return {
        "celery.worker.consumer.consumer": {
            consumer.UNKNOWN_TASK_ERROR: (_unknown_task, True),
            consumer.UNKNOWN_FORMAT: (_unknown_message, True),
            consumer.INVALID_TASK_ERROR: (_invalid_task, True),
            consumer.MESSAGE_DECODE_ERROR: (_decode_error, True),
        },
        "celery.app.trace": {trace.LOG_SUCCESS: (_succeeded, False)},
        "celery.worker.request": {
            "Task %s[%s] succeeded before the worker was lost: %r": (_succeeded_before_lost, False)
        },
        "celery.worker.strategy": {"Couldn't convert ETA %r to timestamp: %r. Task: %r": (_bad_eta, False)},
    }


class CeleryPayloadFilter(logging.Filter):
    """On Celery's own loggers: drop payloads from known records (see the module docstring); never drops a record."""

    def __init__(self, log_payloads: bool) -> None:
        super().__init__()
        self.log_payloads = log_payloads

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if isinstance(data, dict) and PAYLOAD_KEYS & data.keys():
            record.data = {k: v for k, v in data.items() if k not in PAYLOAD_KEYS}
        rule = _rewrites().get(record.name, {}).get(record.msg) if isinstance(record.msg, str) else None
        if rule is None:
            return True
        rewrite, refused = rule
        if not self.log_payloads:
            rewrite(record, _where())
        elif refused and refused_entry():
            record.msg = f"{record.msg.rstrip()}\nDead-lettered as %s"
            record.args = (*(record.args if isinstance(record.args, tuple) else ()), refused_entry())
        return True


def install(log_payloads: bool) -> None:
    """Put the filter on each of Celery's loggers it knows (replacing an earlier one: idempotent)."""
    for name in _rewrites():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, CeleryPayloadFilter)]:
            logger.removeFilter(old)
        logger.addFilter(CeleryPayloadFilter(log_payloads))
