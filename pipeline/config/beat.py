"""The beat schedule, in UTC, and the configuration of the highly available beat that runs it.

Entries: the pipeline's maintenance (`maintenance_entries`) plus the deployment's own, declared in
**one place**, the `BEAT_SCHEDULE` setting (a JSON object: name → `BeatEntry`)::

    BEAT_SCHEDULE='{"nightly-report": {"task": "pdf.render", "cron": "30 2 * * *", "payload": {...}}}'

Beat runs celery-redbeat: the schedule and each entry's last run live in Redis, and only the beat
holding the Redis lock (`pipeline:beat::lock`, lease BEAT_LOCK_TIMEOUT seconds, renewed every tick)
sends anything. Run two beats (one per zone): the standby waits on the lock and takes over within
BEAT_LOCK_TIMEOUT + BEAT_MAX_LOOP_INTERVAL seconds of the active one dying (at once when it stops
cleanly). Missed runs: an entry whose slots passed while no beat was alive fires **once** when a beat
is back, then follows its normal slots (never a burst of catch-up runs).
"""

from __future__ import annotations

from typing import Any

from celery.schedules import crontab, schedule
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Every schedule is read in this timezone (Celery's `timezone` and `enable_utc` agree).
TIMEZONE = "UTC"


class BeatEntry(BaseModel):
    """One user entry of BEAT_SCHEDULE: a task, when (`cron` or `every`), and its payload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = Field(min_length=1)
    #: Five crontab fields, UTC: "minute hour day-of-month month day-of-week".
    cron: str | None = None
    #: Or an interval in seconds.
    every: float | None = Field(default=None, gt=0)
    #: The task's one argument (typed tasks take their payload as a JSON object).
    payload: dict[str, Any] = Field(default_factory=dict)
    queue: str | None = None

    @model_validator(mode="after")
    def _one_timing(self) -> BeatEntry:
        if (self.cron is None) == (self.every is None):
            raise ValueError("give exactly one of 'cron' and 'every'")
        if self.cron is not None:
            parse_cron(self.cron)
        return self

    def as_celery(self) -> dict[str, Any]:
        when = parse_cron(self.cron) if self.cron is not None else schedule(self.every or 0)
        entry: dict[str, Any] = {"task": self.task, "schedule": when, "args": (self.payload,)}
        if self.queue:
            entry["options"] = {"queue": self.queue}
        return entry


def parse_cron(expression: str) -> crontab:
    """A five-field crontab expression (UTC) as Celery's `crontab`; ValueError when malformed."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(f"cron {expression!r}: expected 5 fields (minute hour day month weekday)")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return crontab(minute, hour, day_of_week, day_of_month, month_of_year)


def maintenance_entries() -> dict[str, dict[str, Any]]:
    """The pipeline's own housekeeping: nightly retention and artifact purge at 00:00 UTC."""
    nightly = crontab(minute="0", hour="0")
    return {
        "pipeline.dlq-retention": {"task": "pipeline.dlq_retention", "schedule": nightly, "args": ({},)},
        "pipeline.artifact-purge": {"task": "pipeline.artifact_purge", "schedule": nightly, "args": ({},)},
    }
