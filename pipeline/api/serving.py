"""What the API process sets up once when `uvicorn pipeline.api:app` loads it: the workers' logs and Sentry.

uvicorn configures its own loggers (plain text, their own handlers) before it imports the app; here they
are handed to the root logger, so every line goes through the same JSON/text handler, secret scrubbing
and task-payload rules as a worker's (`pipeline.observability.logs`). The access log never holds
query-string values (`?token=abc` is written `?token=[Filtered]`). Sentry starts with component "api"
(sentry-sdk enables its Starlette/FastAPI integrations itself: an unhandled error becomes an event).
`create_app()` alone sets up nothing process-wide (tests build apps in their own process).
"""

from __future__ import annotations

import logging

from pipeline.observability.logs import configure_logging
from pipeline.observability.sentry import init_sentry, redact_query

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class QueryValuesFilter(logging.Filter):
    """On `uvicorn.access`: the request target's query values replaced (its args are addr, method, path, ...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            record.args = (*args[:2], f"{path}?{redact_query(query)}", *args[3:])
        return True


def setup_process() -> None:
    """Logging as in the workers (uvicorn's loggers included), the access-log filter, then Sentry."""
    configure_logging()
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:  # uvicorn's own handler (none when started with --no-access-log: stays off)
            logger.handlers.clear()
            logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, QueryValuesFilter)]:
        access.removeFilter(old)
    access.addFilter(QueryValuesFilter())
    init_sentry("api")
