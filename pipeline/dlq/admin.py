"""Operating the dead-letter queue: list with filters, show, replay, purge, retention.

The queue is kombu's Redis list `dead_letter` (newest at the left). Reading it never consumes it.
Replay republishes the original payload to the original queue under a new task id and removes the
entry only after that publish returned; a replay that fails leaves the entry where it was.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from celery.utils import uuid

from pipeline import records
from pipeline.broker import broker_redis, decode_message
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import DEAD_LETTER_QUEUE, KEY_PREFIX
from pipeline.dlq.envelope import DeadLetter


class DeadLetterNotFound(LookupError):
    """No dead-letter entry has this id (or task id)."""


class NotReplayable(ValueError):
    """The entry holds no task name or arguments to publish again (for example a refused pickle message)."""


@dataclass(frozen=True)
class Filters:
    task: str | None = None  # exact name or glob ("email.*")
    exception: str | None = None  # class name, qualified or not
    since: datetime | None = None

    def match(self, entry: DeadLetter) -> bool:
        if self.task and not fnmatch.fnmatchcase(entry.task_name or "", self.task):
            return False
        if self.exception and self.exception not in (entry.exception_type, entry.exception_type.rsplit(".", 1)[-1]):
            return False
        return not (self.since and entry.failed_at < self.since)


def _entries(client: redis.Redis) -> Iterator[tuple[Any, DeadLetter]]:
    """(raw list item, envelope) pairs; the raw item is what LREM needs to remove exactly that entry."""
    for raw in client.lrange(DEAD_LETTER_QUEUE, 0, -1):
        try:
            yield raw, DeadLetter.model_validate(decode_message(raw)["body"])
        except ValueError:
            continue  # not an envelope of ours; left untouched


def list_entries(filters: Filters = Filters(), limit: int | None = None) -> list[DeadLetter]:
    """Entries matching `filters`, newest first."""
    with broker_redis() as client:
        found = [entry for _, entry in _entries(client) if filters.match(entry)]
    return found[:limit] if limit else found


def _find(client: redis.Redis, ident: str) -> tuple[Any, DeadLetter]:
    for raw, entry in _entries(client):
        if ident in (entry.id, entry.task_id):
            return raw, entry
    raise DeadLetterNotFound(ident)


def get(ident: str) -> DeadLetter:
    """The entry with this entry id or original task id."""
    with broker_redis() as client:
        return _find(client, ident)[1]


def replay(ident: str) -> str:
    """Publish the entry's job again (new task id, original queue); remove the entry; return the new id."""
    with broker_redis() as client:
        raw, entry = _find(client, ident)
        if not entry.replayable or entry.task_name is None:
            raise NotReplayable(f"{entry.id}: {entry.reason} message has no task and payload to replay")
        lock = f"{KEY_PREFIX}dlq:replaying:{entry.id}"
        if not client.set(lock, "1", nx=True, ex=60):
            raise NotReplayable(f"{entry.id} is being replayed by another process")
        try:
            new_id = uuid()
            records.record_accepted(new_id, entry.task_name)
            get_app().send_task(
                entry.task_name,
                args=entry.args,
                kwargs=entry.kwargs or {},
                queue=entry.queue,
                task_id=new_id,
                headers=entry.headers,
            )
            client.lrem(DEAD_LETTER_QUEUE, 1, raw)
        finally:
            client.delete(lock)
    return new_id


def delete(ident: str) -> DeadLetter:
    """Remove one entry without running it."""
    with broker_redis() as client:
        raw, entry = _find(client, ident)
        client.lrem(DEAD_LETTER_QUEUE, 1, raw)
    return entry


def purge(older_than: timedelta | None = None, filters: Filters = Filters()) -> int:
    """Remove entries (all, or those older than `older_than`) matching `filters`; return how many."""
    cutoff = datetime.now(UTC) - older_than if older_than is not None else None
    removed = 0
    with broker_redis() as client:
        for raw, entry in list(_entries(client)):
            if filters.match(entry) and (cutoff is None or entry.failed_at < cutoff):
                removed += int(client.lrem(DEAD_LETTER_QUEUE, 1, raw))
    return removed


def apply_retention() -> int:
    """Drop entries past DLQ_MAX_AGE and beyond the newest DLQ_MAX_ENTRIES; return how many went."""
    settings = get_settings()
    removed = purge(older_than=timedelta(seconds=settings.dlq_max_age))
    with broker_redis() as client:
        before = int(client.llen(DEAD_LETTER_QUEUE))
        if before > settings.dlq_max_entries:
            client.ltrim(DEAD_LETTER_QUEUE, 0, settings.dlq_max_entries - 1)  # left end holds the newest
            removed += before - int(client.llen(DEAD_LETTER_QUEUE))
    return removed
