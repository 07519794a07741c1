"""Producer-side idempotency: the same idempotency key yields the same job, not a second one.

A key is claimed with `SET NX` (TTL ENQUEUE_IDEMPOTENCY_TTL) holding the new job's id; a later enqueue with
the key gets that id back. A job due now claims its key in the same atomic call that stores it
(`pipeline.producer.script`), so a failed publish claims nothing. A job with an ETA claims it here first; if
publishing then fails, the claim is released so a retry of the enqueue can succeed. A job that was written but
not confirmed by REDIS_WAIT_REPLICAS replicas (`NotReplicated`, raised after the claim's block) keeps its claim:
the retry gets that job's id, once it is replicated, and never makes a second job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from celery.utils import uuid

from pipeline.config import get_settings
from pipeline.producer.client import producer_redis
from pipeline.queues import keys


@dataclass(frozen=True)
class Claim:
    task_id: str
    #: Set when the key was already claimed: the id of the job enqueued first.
    existing_id: str | None = None


def redis_key(task_name: str, key: str, queue: str) -> str:
    """The Redis key holding the id of the job that claimed idempotency `key` for `task_name` (a task of `queue`: on a
    Redis Cluster the key lives in the queue's slot, beside the lists the job goes on)."""
    return keys.idempotency(queue, task_name, key)


@contextmanager
def claim(task_name: str, key: str | None, queue: str) -> Iterator[Claim]:
    """Claim `key` for a new job of `task_name` (of `queue`); yields the id to publish under (or the existing one)."""
    new_id = uuid()
    if not key:
        yield Claim(new_id)
        return
    held = redis_key(task_name, key, queue)
    client = producer_redis()
    for _ in range(3):  # the holder may expire between SET NX and GET
        if client.set(held, new_id, nx=True, ex=get_settings().enqueue_idempotency_ttl):
            break
        existing = client.get(held)
        if existing is not None:
            first = existing.decode() if isinstance(existing, bytes) else str(existing)
            yield Claim(first, existing_id=first)
            return
    try:
        yield Claim(new_id)
    except BaseException:
        client.delete(held)
        raise
