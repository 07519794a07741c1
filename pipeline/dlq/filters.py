"""Which dead-letter entries an operation selects: task, exception, age; and how people write times and ages.

`parse_time` and `parse_duration` read the `since` / `older-than` values of the CLI and the API alike;
a bad value is a `BadFilter` (a ValueError), which the CLI reports as a bad option and the API as a 422.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pipeline.dlq.envelope import DeadLetter

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class BadFilter(ValueError):
    """A time or an age that cannot be read."""


def parse_duration(text: str) -> timedelta:
    """'90', '90s', '15m', '12h', '7d', '2w' → timedelta."""
    match = _DURATION.match(text)
    if not match:
        raise BadFilter(f"{text!r} is not a duration like 90s, 15m, 12h or 7d")
    try:
        return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    except OverflowError:
        raise BadFilter(f"{text!r} is too long a duration") from None


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (naive means UTC) or a duration ago ('1h')."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            return datetime.now(UTC) - parse_duration(text)
        except OverflowError:
            raise BadFilter(f"{text!r} is too long ago") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


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


#: Every entry.
EVERYTHING = Filters()
