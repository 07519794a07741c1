"""Retry policy as data: which errors retry, how often, and how long to wait between attempts.

A task declares one `RetryPolicy`; `PipelineTask` interprets it through Celery's own `Task.retry`
(the retry is a new message with a countdown, counted in `request.retries`, so `max_retries` and the
result backend's RETRY state behave as every Celery user expects).

The wait before retry *n* (n = 0 for the first retry) is ``min(max_delay, base_delay * 2**n)``,
scaled by a random factor in ``[1 - jitter, 1 + jitter]``: 2, 4, 8, 16 s by default, each ±20 %, so
retries from many failed jobs spread out instead of arriving together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipeline.errors import PermanentError, TransientError

#: The ceiling on any single wait.
MAX_DELAY_CEILING = 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """How a task retries. Defaults come from settings; tasks override fields with `replace()`."""

    max_attempts: int = 5
    base_delay: float = 2.0
    max_delay: float = 600.0
    jitter: float = 0.2
    #: Exceptions that retry besides `TransientError` (connection errors, timeouts, a client's 5xx error...).
    transient: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError("delays must satisfy 0 <= base_delay <= max_delay")
        if self.max_delay > MAX_DELAY_CEILING:
            raise ValueError(f"max_delay is capped at {MAX_DELAY_CEILING:.0f} s")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")

    @property
    def max_retries(self) -> int:
        """Celery's count: retries after the first attempt."""
        return self.max_attempts - 1

    @property
    def retry_on(self) -> tuple[type[BaseException], ...]:
        return (TransientError, *self.transient)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, self.retry_on) and not isinstance(exc, PermanentError)

    def nominal_delay(self, retries: int) -> float:
        """The wait before retry number `retries` (0-based), without jitter."""
        return min(self.max_delay, self.base_delay * (2.0**retries))

    def delay(self, retries: int) -> float:
        """The wait before retry number `retries`, with jitter applied."""
        factor = 1.0 + random.uniform(-self.jitter, self.jitter)  # noqa: S311 - spreading load, not security
        return max(0.0, self.nominal_delay(retries) * factor)
