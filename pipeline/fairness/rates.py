"""A cluster-wide rate limit as a task declares it (`typed_task(cluster_rate=..., cluster_burst=..., rate_key=...)`);
the limiter that enforces it is `pipeline.scheduling.ratelimit`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from celery.utils.time import rate as per_second


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
