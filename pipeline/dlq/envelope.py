"""The dead-letter envelope and how one is written.

A job that fails for good (permanent error, retries exhausted, time limit, a killed child past its
retries) and a message the worker refuses (pickle or other disallowed content, unknown task name,
undecodable body) become one `DeadLetter` envelope, published as a JSON message to the durable
`dead_letter` queue. No worker consumes that queue; `pipeline.dlq.admin` lists, shows, replays and
purges it.

The envelope is the message kombu would publish (captured with `pipeline.publish.capture`, so it is
byte for byte kombu's own), LPUSHed together with its index entries and the retention trim in one
transaction by `pipeline.dlq.store`.

If the broker cannot take the envelope (it is down), the envelope is written to a spool directory
under DATA_DIR and published by `flush_spool()` later (at worker start and by the nightly
maintenance task), so a failed job is never lost silently.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kombu import Exchange, Producer, Queue
from kombu.exceptions import OperationalError
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import DEAD_LETTER_QUEUE, HEADER_FLOW
from pipeline.dlq import store
from pipeline.observability import metrics
from pipeline.publish import capture
from pipeline.queues import keys

log = logging.getLogger(__name__)

#: The durable queue envelopes are published to (direct exchange, routing key = queue name).
DLQ = Queue(
    DEAD_LETTER_QUEUE, Exchange(DEAD_LETTER_QUEUE, type="direct", durable=True), DEAD_LETTER_QUEUE, durable=True
)
TRACEBACK_LIMIT = 20_000
#: Fields a foreign message fills (names, ids, error text) are cut to this many characters.
TEXT_LIMIT = 2_000
Reason = Literal["failed", "rejected", "unknown_task", "undecodable", "delivery_limit"]
#: Delivery history entries an envelope keeps (the newest).
DELIVERIES_LIMIT = 20
#: Pauses between attempts to write an envelope before it is spooled (a broker blip is not an outage).
RETRY_PAUSES_S = (0.2, 0.7, 1.2)


class DeadLetterRow(BaseModel):
    """One entry as a row of a listing: `pipeline dlq list --json` and `GET /dlq` answer these."""

    id: str
    task_id: str | None
    task: str | None
    queue: str | None
    reason: Reason
    exception: str
    message: str
    attempts: int
    failed_at: str
    replayable: bool
    flow: str | None = None


class DeadLetter(BaseModel):
    """One dead-lettered job: enough to understand the failure and to run the job again."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    reason: Reason
    task_name: str | None = None
    task_id: str | None = None
    queue: str | None = None
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None
    attempts: int = 1
    exception_type: str
    exception_message: str = ""
    traceback: str | None = None
    failed_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    worker: str = Field(default_factory=socket.gethostname)
    content_type: str | None = None
    #: For a refused message: the start of its raw body, as text (it is never deserialised).
    body_preview: str | None = None
    #: For a refused message whose body is kept only as a preview: its whole size and sha256.
    body_size: int | None = None
    body_sha256: str | None = None
    headers: dict[str, Any] = Field(default_factory=dict)
    #: For reason `delivery_limit`: each delivery of the message, oldest first ({"at": ISO time, "worker": name}).
    deliveries: list[dict[str, Any]] = Field(default_factory=list, max_length=DELIVERIES_LIMIT)

    @property
    def payload(self) -> Any:
        """The job's payload: its single positional argument, for the typed tasks."""
        return self.args[0] if self.args and len(self.args) == 1 and not self.kwargs else None

    @property
    def flow_step(self) -> str | None:
        """`<flow> <flow id> <node>` for a step of a flow (its HEADER_FLOW), else None."""
        ref = self.headers.get(HEADER_FLOW)
        if not isinstance(ref, dict):
            return None
        item = ref.get("item")
        node = ref.get("step") if item is None else f"{ref.get('step')}[{item}]"
        return f"{ref.get('flow')} {ref.get('id')} {node}"

    @property
    def replayable(self) -> bool:
        return bool(self.task_name) and self.args is not None

    def row(self) -> DeadLetterRow:
        return DeadLetterRow(
            id=self.id,
            task_id=self.task_id,
            task=self.task_name,
            queue=self.queue,
            reason=self.reason,
            exception=self.exception_type,
            message=self.exception_message,
            attempts=self.attempts,
            failed_at=self.failed_at.isoformat(),
            replayable=self.replayable,
            flow=self.flow_step,
        )


_TEXT_FIELDS = ("task_name", "task_id", "queue", "exception_type", "exception_message", "content_type")


def exception_name(exc: BaseException | None) -> str:
    if exc is None:
        return "UnknownMessage"
    cls = type(exc)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def publish(entry: DeadLetter) -> str:
    """Publish `entry` to the dead-letter queue (returns its id), or spool it to disk if the broker refuses."""
    if entry.traceback and len(entry.traceback) > TRACEBACK_LIMIT:
        entry = entry.model_copy(update={"traceback": "...\n" + entry.traceback[-TRACEBACK_LIMIT:]})
    long = {f: v[:TEXT_LIMIT] for f in _TEXT_FIELDS if isinstance(v := getattr(entry, f), str) and len(v) > TEXT_LIMIT}
    if long:
        entry = entry.model_copy(update=long)
    body = entry.model_dump(mode="json")
    try:
        _send(body)
    except Exception:
        path = _spool_dir() / f"{entry.id}.json"
        path.write_text(json.dumps(body))
        log.exception("dead-letter publish failed; envelope %s spooled to %s", entry.id, path)
        raise
    task = entry.task_name if entry.task_name in get_app().tasks else metrics.UNREGISTERED  # bounded label set
    metrics.tasks.labels(task=task, queue=entry.queue or "unknown", outcome="dead_lettered").inc()
    log.warning(
        "dead-lettered %s[%s] as %s (%s: %s)",
        entry.task_name,
        entry.task_id,
        entry.id,
        entry.exception_type,
        entry.exception_message[:200],
    )
    return entry.id


def _send(body: dict[str, Any]) -> None:
    """Write one envelope (and its index entries, and the retention trim) to Redis, retrying a broker blip."""

    def send(producer: Producer) -> None:
        # The default exchange routes by queue name, so delivery never depends on a stored binding.
        # On a cluster nothing is declared: kombu's declare reads the list on one node, whichever slot it serves.
        declare = [] if keys.clustered() else [DLQ]
        producer.publish(
            body, exchange="", routing_key=DEAD_LETTER_QUEUE, declare=declare, serializer="json", delivery_mode=2
        )

    for pause in (*RETRY_PAUSES_S, None):
        try:
            message = capture(send)
            if message.dest != DEAD_LETTER_QUEUE:
                raise RuntimeError(f"a dead-letter envelope was routed to {message.dest!r}")
            store.push(message.body, body["id"], body.get("task_id"), get_settings().dlq_max_entries)
            return
        except (OperationalError, RedisConnectionError, RedisTimeoutError):
            if pause is None:
                raise
            time.sleep(pause)


def _spool_dir() -> Path:
    path = get_settings().data_dir / "dlq-spool"
    path.mkdir(parents=True, exist_ok=True)
    return path


def flush_spool() -> int:
    """Publish envelopes spooled while the broker was unreachable; return how many went out."""
    directory = get_settings().data_dir / "dlq-spool"
    if not directory.is_dir():
        return 0
    sent = 0
    for path in sorted(directory.glob("*.json")):
        _send(json.loads(path.read_text()))
        os.unlink(path)
        sent += 1
    if sent:
        log.info("published %d spooled dead-letter envelope(s)", sent)
    return sent
