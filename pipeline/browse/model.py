"""The job browser's vocabulary: its states, the row and page models, and opaque cursors.

A cursor is base64url JSON naming its queue and state and holding a position: an offset into the lists,
else the last row's (score, id). One issued for another queue or state, or not issued at all, is refused.
"""

from __future__ import annotations

import base64
import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

MAX_LIMIT = 500


class BrowseState(StrEnum):
    WAITING = "waiting"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"


class BadCursor(ValueError):
    """The cursor was not issued for this queue and state (or is not a cursor at all)."""

    def __init__(self) -> None:
        super().__init__("cursor is not a next_cursor of this queue and state; start again without one")


class JobRow(BaseModel):
    """One job in a listing: no payload, no result; `GET /jobs/{id}` has the detail."""

    id: str
    task: str | None
    queue: str
    state: BrowseState
    attempts: int | None = Field(
        default=None, description="Attempts made so far, the one under way included (0 while waiting)."
    )
    priority: int | None = Field(
        default=None, description="A waiting, scheduled or running job's priority (0 most urgent .. 9), as sent."
    )
    enqueued_at: str | None = Field(default=None, description="When it was published or accepted (ISO 8601, UTC).")
    due_at: str | None = Field(default=None, description="When a scheduled job is released (ISO 8601, UTC).")
    finished_at: str | None = Field(default=None, description="When its last attempt ended (ISO 8601, UTC).")
    exception: str | None = Field(default=None, description="The exception type of a failed or retrying job.")
    dlq_id: str | None = Field(default=None, description="The dead-letter entry (`GET /dlq/{id}`).")


class JobPage(BaseModel):
    queue: str
    state: BrowseState
    total: int = Field(description="Jobs in this queue and state.")
    jobs: list[JobRow]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")
    counts: dict[str, dict[BrowseState, int]] = Field(description="Queue → state → number of jobs.")
    waiting_levels: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Queue → priority level → waiting jobs, most urgent first: level '0' holds priorities 0-2, "
        "'3' 3-5, '6' 6-8, '9' 9; workers empty a level before taking the next.",
    )


def encode_cursor(queue: str, state: BrowseState, position: Any) -> str:
    raw = json.dumps({"q": queue, "s": state.value, "p": position}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, queue: str, state: BrowseState) -> Any:
    if not cursor:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if data["q"] == queue and data["s"] == state.value:
            return data["p"]
    except (ValueError, TypeError, KeyError):
        pass
    raise BadCursor


def cursor_offset(position: Any) -> int:
    if isinstance(position, int) and position >= 0:
        return position
    raise BadCursor


def cursor_after(position: Any) -> tuple[float, str] | None:
    if position is None:
        return None
    if isinstance(position, list) and len(position) == 2 and isinstance(position[1], str):
        try:
            return float(position[0]), position[1]
        except (TypeError, ValueError):
            pass
    raise BadCursor
