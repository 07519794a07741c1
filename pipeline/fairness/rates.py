"""A cluster-wide rate limit as a task declares it (`typed_task(cluster_rate=..., cluster_burst=..., rate_key=...)`);
the limiter that enforces it is `pipeline.scheduling.ratelimit`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from celery.utils.time import rate as per_second

from pipeline.constants import RATE_LIMIT_KEY


@dataclasses.dataclass(frozen=True)
class ClusterRate:
    """A limit shared by every worker: `rate` ("20/s", or a callable read when the job runs), up to `burst`
    jobs at once, one limit per `key(job)` when given. Declared with `typed_task(cluster_rate=...)`."""

    rate: str | Callable[[], str]
    burst: int = 1
    key: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rate, str):
            self.interval()  # a malformed rate fails where the task is declared
        if self.burst < 1:
            raise ValueError("cluster_burst must be at least 1")

    def interval(self) -> float:
        """Seconds between two jobs (Celery's rate syntax: N/s, N/m, N/h)."""
        text = self.rate() if callable(self.rate) else self.rate
        try:
            jobs_per_second = float(per_second(text))
        except (KeyError, ValueError):
            jobs_per_second = 0.0
        if jobs_per_second <= 0:
            raise ValueError(f"rate {text!r}: expected N/s, N/m or N/h with N > 0")
        return 1 / jobs_per_second

    def interval_and_tolerance_ms(self) -> tuple[float, float]:
        """GCRA's emission interval and burst tolerance, in ms (`rate_acquire.lua`'s and `fetch.lua`'s ARGV)."""
        interval_ms = self.interval() * 1000
        return interval_ms, (self.burst - 1) * interval_ms

    def suffix(self, job: Any) -> str | None:
        """`key(job)`, the part of the limiter's key that is the job's own; None for a limit without a key."""
        return None if self.key is None else str(self.key(job))

    @staticmethod
    def redis_key(task_name: str, suffix: str | None) -> str:
        """The limiter's key in Redis: one per task, or one per task and `suffix` (`suffix(job)`)."""
        base = RATE_LIMIT_KEY.format(task=task_name)
        return base if suffix is None else f"{base}:{suffix}"
