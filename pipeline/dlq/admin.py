"""Operating the dead-letter queue: list with filters, show, replay, delete, purge, retention.

The queue is kombu's Redis list `dead_letter` (newest at the left), indexed by `pipeline.dlq.store`:
showing, replaying or deleting one entry (by entry id or original task id) is O(1) and never reads the
list; listing and purging with filters scan it. Reading never consumes it. Replay republishes the
original payload to the original queue under a new task id and removes the entry only after that
publish returned; a replay that fails leaves the entry where it was.

A replay is written like a typed enqueue: Celery's message for it, captured (`pipeline.publish.capture`), stored
with its accepted-job record by the producer's script (`pipeline.producer.script`) in one round trip, which also
claims an idempotency key named after the entry (`dlq-replay:<entry id>`). With REDIS_WAIT_REPLICAS=N >= 1 the
same round trip waits for N replicas; if they do not confirm in time the replay raises `NotReplicated` and the
entry stays, and replaying it again (within ENQUEUE_IDEMPOTENCY_TTL) answers with the same new task id, once
replicated, and removes the entry: never a second job. At maxmemory it raises `BrokerFull` and stores nothing.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from celery.utils import uuid

from pipeline import records
from pipeline.broker import broker_redis, decode_message, memory_refusals
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import HEADER_FLOW, KEY_PREFIX
from pipeline.dlq import store
from pipeline.dlq.envelope import DeadLetter, DeadLetterRow
from pipeline.dlq.filters import EVERYTHING, Filters
from pipeline.flows.record import Ref, replaced
from pipeline.producer import idempotency
from pipeline.producer.script import store_jobs
from pipeline.publish import capture, declare_option
from pipeline.queues import keys

__all__ = [
    "DeadLetter",
    "DeadLetterNotFound",
    "DeadLetterRow",
    "Filters",
    "NotReplayable",
    "apply_retention",
    "delete",
    "find",
    "find_tasks",
    "get",
    "list_entries",
    "purge",
    "replay",
]


class DeadLetterNotFound(LookupError):
    """No dead-letter entry has this id (or task id)."""


class NotReplayable(ValueError):
    """The entry holds no task name or arguments to publish again (for example a refused pickle message)."""


def _parse(raw: bytes | str) -> DeadLetter | None:
    try:
        return DeadLetter.model_validate(decode_message(raw)["body"])
    except (ValueError, TypeError, KeyError):
        return None  # not an envelope of ours; left untouched


def list_entries(filters: Filters = EVERYTHING, limit: int | None = None) -> list[DeadLetter]:
    """Entries matching `filters`, newest first."""
    with broker_redis() as client:
        raws = store.elements(client)
    found = [entry for entry in map(_parse, raws) if entry is not None and filters.match(entry)]
    return found[:limit] if limit else found


def _lookup(ident: str) -> tuple[bytes, DeadLetter]:
    raw = store.lookup(ident)
    entry = _parse(raw) if raw is not None else None
    if raw is None or entry is None:
        raise DeadLetterNotFound(f"no dead-letter entry {ident}")
    return raw, entry


def find(ident: str) -> DeadLetter | None:
    """The entry with this entry id or original task id, or None (O(1): the list is not read)."""
    try:
        return _lookup(ident)[1]
    except DeadLetterNotFound:
        return None


def find_tasks(task_ids: list[str]) -> dict[str, DeadLetter]:
    """The entry of each of these original task ids that has one (two round trips however many they are)."""
    parsed = {task_id: _parse(raw) for task_id, raw in store.lookup_tasks(task_ids).items()}
    return {task_id: entry for task_id, entry in parsed.items() if entry is not None}


def get(ident: str) -> DeadLetter:
    """The entry with this entry id or original task id."""
    return _lookup(ident)[1]


def replay(ident: str) -> str:
    """Publish the entry's job again (new task id, original queue); remove the entry; return the new id."""
    raw, entry = _lookup(ident)
    if not entry.replayable or entry.task_name is None:
        raise NotReplayable(f"{entry.id}: {entry.reason} message has no task and payload to replay")
    with broker_redis() as client:
        lock = f"{KEY_PREFIX}dlq:replaying:{entry.id}"
        if not client.set(lock, "1", nx=True, ex=60):
            raise NotReplayable(f"{entry.id} is being replayed by another process")
        try:
            if store.lookup(entry.id) is None:  # replayed or deleted since it was read
                raise DeadLetterNotFound(f"no dead-letter entry {ident}")
            with memory_refusals():
                new_id = _republish(client, entry, entry.task_name)
            store.remove_one(client, raw)
        finally:
            client.delete(lock)
    step = Ref.of(entry.headers.get(HEADER_FLOW))
    if step is not None:  # the flow runs on from this step (the job also says so as it starts)
        replaced(step, new_id)
    return new_id


def _republish(client: redis.Redis, entry: DeadLetter, name: str) -> str:
    """Store the entry's job (task `name`) again under a new task id, or, when it was replayed before but not
    confirmed, answer with the id it got then; return the id."""
    new_id = uuid()

    def send(producer: Any) -> Any:
        options = {"queue": entry.queue, "task_id": new_id, "headers": entry.headers, "producer": producer}
        options.update(declare_option())
        return get_app().send_task(name, args=entry.args, kwargs=entry.kwargs or {}, **options)

    message = capture(send)
    queue = keys.queue_of(message.dest)
    record, ttl = records.accepted_entry(name, queue=queue)
    events = [
        (str(args[0]), str(args[1].decode() if isinstance(args[1], bytes) else args[1])) for _, args in message.extra
    ]
    claim = (idempotency.redis_key(name, f"dlq-replay:{entry.id}", queue), get_settings().enqueue_idempotency_ttl)
    first = store_jobs(
        client,
        queue=queue,
        dest=message.dest,
        record=record,
        record_ttl=ttl,
        now=time.time(),
        ids=[new_id],
        messages=[message.body],
        channel=events[0][0] if events else "",
        events=[body for _, body in events],
        claim=claim,
    )
    return first or new_id


def delete(ident: str) -> DeadLetter:
    """Remove one entry without running it."""
    raw, entry = _lookup(ident)
    with broker_redis() as client:
        if not store.remove_one(client, raw):
            raise DeadLetterNotFound(f"no dead-letter entry {ident}")
    return entry


def purge(older_than: timedelta | None = None, filters: Filters = EVERYTHING) -> int:
    """Remove entries (all, or those older than `older_than`) matching `filters`; return how many."""
    cutoff = datetime.now(UTC) - older_than if older_than is not None else None

    def doomed(_: int, raw: bytes) -> bool:
        entry = _parse(raw)
        return entry is not None and filters.match(entry) and (cutoff is None or entry.failed_at < cutoff)

    return store.remove_where(doomed)


def apply_retention() -> int:
    """Drop entries past DLQ_MAX_AGE and beyond the newest DLQ_MAX_ENTRIES; return how many went."""
    settings = get_settings()
    removed = purge(older_than=timedelta(seconds=settings.dlq_max_age))
    return removed + store.remove_where(lambda position, _: position >= settings.dlq_max_entries)
