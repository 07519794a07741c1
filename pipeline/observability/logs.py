"""Logs and error reports: one structured line per event, with the running task's identity bound.

`configure_logging()` installs one handler on the root logger: JSON lines by default, readable text
when LOG_FORMAT=text (LOG_FORMAT=auto, the default, means text when ENVIRONMENT=development). Every
record written while a task runs — by the task's own code, by libraries, by Celery — carries
`task_id`, `task_name`, `queue` and `attempt`, read from Celery's current task by a handler filter
(so it also works in thread pools). Known secret values and URL credentials are removed from each
line, and Celery's own lines carry no task payload, result or message body unless LOG_PAYLOADS=true
(`pipeline.observability.payloads`). Celery calls it through the `setup_logging` signal (worker, pool
children, beat); other processes (the API) call it themselves, as they call `init_sentry` (re-exported
from `pipeline.observability.sentry`).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from celery import current_task

from pipeline.config import get_settings
from pipeline.observability import payloads
from pipeline.observability.payloads import PAYLOAD_KEYS
from pipeline.observability.sentry import init_sentry, scrub_text, secret_values

__all__ = ["configure_logging", "init_sentry"]
TASK_FIELDS = ("task_id", "task_name", "queue", "attempt")
TEXT_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s%(task_suffix)s"
# uvicorn adds `color_message` (its template with terminal colours): not a field worth a JSON key
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "task_suffix",
    "color_message",
    *TASK_FIELDS,
}


class TaskContextFilter(logging.Filter):
    """Bind the current task's id, name, queue and attempt to every record (None outside tasks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        task = current_task  # Celery's proxy to the task this thread runs: no attributes outside one
        request = getattr(task, "request", None)
        if request is not None and getattr(request, "id", None):
            info = getattr(request, "delivery_info", None) or {}
            name, attempt = getattr(task, "name", None), int(getattr(request, "retries", 0) or 0) + 1
            record.task_id, record.task_name, record.attempt = request.id, name, attempt
            record.queue = info.get("routing_key")
            record.task_suffix = f" [{name} {request.id} attempt={attempt}]"
        else:
            for field in TASK_FIELDS:
                setattr(record, field, getattr(record, field, None))
            record.task_suffix = ""
        return True


def _no_payload(value: Any) -> Any:
    """Celery's log extras (`data`) carry the task's args, kwargs and return value: never write those."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in PAYLOAD_KEYS}
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, process, message, task fields, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": record.processName,
            "message": record.getMessage(),
        }
        line.update({f: getattr(record, f, None) for f in TASK_FIELDS if getattr(record, f, None) is not None})
        line.update({k: _no_payload(v) for k, v in record.__dict__.items() if k not in _STANDARD and k[0] != "_"})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class ScrubbingHandler(logging.StreamHandler):  # type: ignore[type-arg]  # the stream's type does not matter here
    """A stream handler that removes secret values and URL credentials from each formatted line."""

    def __init__(self, secrets: list[str], stream: Any = None) -> None:
        super().__init__(stream or sys.stderr)
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return scrub_text(super().format(record), self.secrets, emails=False)


def log_format() -> str:
    settings = get_settings()
    if settings.log_format != "auto":
        return settings.log_format
    return "text" if settings.environment == "development" else "json"


def configure_logging(level: str | int | None = None, logfile: str | None = None) -> None:
    """Replace the root logger's handlers with the pipeline's one (idempotent); stderr unless `logfile`."""
    settings = get_settings()
    stream = open(logfile, "a", encoding="utf-8", buffering=1) if logfile else None  # noqa: SIM115  # lives as long as the process
    handler = ScrubbingHandler(secret_values(settings), stream)
    handler.addFilter(TaskContextFilter())
    handler.setFormatter(JsonFormatter() if log_format() == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level or settings.log_level)
    payloads.install(settings.log_payloads)
