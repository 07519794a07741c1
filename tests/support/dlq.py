"""Waiting for a job's dead-letter entry (imported by test modules, after the session's settings exist)."""

from __future__ import annotations

import hashlib

from pipeline.dlq import admin as dlq_admin
from tests.support.procs import wait_for


def dead_letter(task_id: str, timeout: float = 60) -> dlq_admin.DeadLetter:
    """The dead-letter entry of `task_id`, once it appears (TimeoutError otherwise)."""

    def find() -> dlq_admin.DeadLetter | None:
        try:
            return dlq_admin.get(task_id)
        except dlq_admin.DeadLetterNotFound:
            return None

    entry = wait_for(find, timeout, 0.1, what=f"dead-letter entry for {task_id}")
    assert isinstance(entry, dlq_admin.DeadLetter)
    return entry


def dead_lettered_as_undecodable(raw: bytes) -> bool:
    """An `undecodable` entry for exactly these bytes is in the dead-letter queue (the app's broker)."""
    digest = hashlib.sha256(raw).hexdigest()
    return any(e.reason == "undecodable" and e.body_sha256 == digest for e in dlq_admin.list_entries())
