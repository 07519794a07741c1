"""Parsing of durations, times and payload input for the `pipeline` command; URLs shown without passwords."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import typer

from pipeline.broker import redact_url
from pipeline.cli.output import parse_duration, parse_time, read_payload


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 604800)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


def test_bad_duration_is_a_clear_error() -> None:
    with pytest.raises(typer.BadParameter, match="not a duration"):
        parse_duration("soon")


def test_times_iso_or_ago() -> None:
    assert parse_time("2026-01-02T03:04:05") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert abs((datetime.now(UTC) - parse_time("1h")) - timedelta(hours=1)) < timedelta(seconds=5)


def test_payload_from_json_and_flags(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"to": ["a@example.com"], "variables": {"name": "A"}}')
    payload = read_payload(f"@{path}", ["variables.code=123", "subject=Hi", "count=3"])
    assert payload == {"to": ["a@example.com"], "variables": {"name": "A", "code": 123}, "subject": "Hi", "count": 3}


def test_payload_must_be_an_object() -> None:
    with pytest.raises(typer.BadParameter, match="JSON object"):
        read_payload("[1, 2]", [])


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://app:p:w-9@h:6380/1", "rediss://app:***@h:6380/1"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),  # no password: unchanged
        ("at redis://:x@h/0 via http://h:80 to a@b.org", "at redis://:***@h/0 via http://h:80 to a@b.org"),
        ("sentinel://:s1@a:26379;sentinel://:s2@b:26379", "sentinel://:***@a:26379;sentinel://:***@b:26379"),
    ],
)  # fmt: skip
def test_url_passwords_are_redacted(text: str, shown: str) -> None:
    assert redact_url(text) == shown
    assert redact_url(text, "[Filtered]").count("[Filtered]") == shown.count("***")
