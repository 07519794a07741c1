"""Producer-side idempotency: the same idempotency key yields the same job, not a second one.

A key is claimed with `SET NX` (TTL ENQUEUE_IDEMPOTENCY_TTL) holding the new job's id before it is
published; a later enqueue with the key gets that id back. If publishing fails, the claim is released
so a retry of the enqueue can succeed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from celery.utils import uuid

from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.constants import ENQUEUE_IDEMPOTENCY_KEY


@dataclass(frozen=True)
class Claim:
    task_id: str
    #: Set when the key was already claimed: the id of the job enqueued first.
    existing_id: str | None = None


@contextmanager
def claim(task_name: str, key: str | None) -> Iterator[Claim]:
    """Claim `key` for a new job of `task_name`; yields the id to publish under (or the existing one)."""
    new_id = uuid()
    if not key:
        yield Claim(new_id)
        return
    redis_key = ENQUEUE_IDEMPOTENCY_KEY.format(task=task_name, key=key)
    with broker_redis() as client:
        for _ in range(3):  # the holder may expire between SET NX and GET
            if client.set(redis_key, new_id, nx=True, ex=get_settings().enqueue_idempotency_ttl):
                break
            existing = client.get(redis_key)
            if existing is not None:
                first = existing.decode() if isinstance(existing, bytes) else str(existing)
                yield Claim(first, existing_id=first)
                return
        try:
            yield Claim(new_id)
        except BaseException:
            client.delete(redis_key)
            raise
