"""Shared pieces of the `pipeline` command: times and durations as options, JSON output, payload input."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import typer

from pipeline.broker import full, oom_cause, redact_url
from pipeline.dlq import filters
from pipeline.errors import BrokerWriteRefused, PayloadInvalid


def parse_duration(text: str) -> timedelta:
    """'90', '90s', '15m', '12h', '7d', '2w' → timedelta (a bad value is a bad option)."""
    try:
        return filters.parse_duration(text)
    except filters.BadFilter as exc:
        raise typer.BadParameter(str(exc)) from None


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (naive means UTC) or a duration ago ('1h') (a bad value is a bad option)."""
    try:
        return filters.parse_time(text)
    except filters.BadFilter as exc:
        raise typer.BadParameter(str(exc)) from None


def emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def fail(message: str, code: int = 1, as_json: bool = False) -> typer.Exit:
    """Print an error for a person (stderr) or a machine (JSON on stdout) and return the exit to raise."""
    if as_json:
        emit_json({"error": message})
    else:
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def invalid(exc: PayloadInvalid, as_json: bool = False) -> typer.Exit:
    """Exit 2 with the field errors of an invalid payload or flow input (for a batch, each `loc` starts with the
    item's index)."""
    if as_json:
        emit_json({"error": "invalid payload", "task": exc.task, "details": exc.errors})
        return typer.Exit(2)
    return fail(str(exc), 2)


#: Exit status of a command whose write the broker refused as durable (`BrokerWriteRefused`), as for an
#: unreachable Redis: nothing was accepted, retry later.
BROKER_EXIT = 3


def refused(exc: Exception, as_json: bool = False) -> typer.Exit:
    """One line for a write the broker refused (replicas did not confirm it, or Redis is at maxmemory): exit 3."""
    return fail(str(exc), BROKER_EXIT, as_json)


@contextmanager
def exits(as_json: bool, codes: dict[type[Exception], int]) -> Iterator[None]:
    """A command's failures as exits: an invalid payload exits 2 with its field errors, each exception of `codes`
    with its code and its message, a write the broker refused 3 (`refused`)."""
    try:
        yield
    except PayloadInvalid as exc:
        raise invalid(exc, as_json) from None
    except BrokerWriteRefused as exc:
        raise refused(exc, as_json) from None
    except tuple(codes) as exc:
        code = next(code for kind, code in codes.items() if isinstance(exc, kind))
        raise fail(str(exc), code, as_json) from None


@contextmanager
def broker_errors() -> Iterator[None]:
    """Turn 'Redis is unreachable' (from kombu, redis-py or Celery's result backend) into one clear error."""
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from pipeline.config import get_settings

    try:
        yield
    except (OperationalError, RedisConnectionError, RedisTimeoutError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "result store" not in str(exc):
            raise
        refusal = oom_cause(exc)  # kombu re-raises Redis's OOM refusal as a connection error
        if refusal is not None:
            typer.secho(f"error: {full(refusal)}", fg=typer.colors.RED, err=True)
            raise SystemExit(BROKER_EXIT) from None
        reason = " ".join(str(exc).split()) or type(exc).__name__
        typer.secho(
            f"error: cannot reach Redis at {redact_url(get_settings().broker_url)}: {reason}",
            fg=typer.colors.RED,
            err=True,
        )
        raise SystemExit(BROKER_EXIT) from None


def _set_path(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
    target[leaf] = value


def read_payload(source: str | None, assignments: list[str]) -> dict[str, Any]:
    """Payload from JSON text, `@file` or `-` (stdin), then `key=value` flags (dots nest; JSON values parsed)."""
    payload: Any = {}
    if source:
        text = sys.stdin.read() if source == "-" else Path(source[1:]).read_text() if source[0] == "@" else source
        try:
            payload = json.loads(text)
        except ValueError as exc:
            raise typer.BadParameter(f"payload is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise typer.BadParameter("payload must be a JSON object")
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        _set_path(payload, key, value)
    return payload


def read_payloads(source: str) -> list[Any]:
    """Payloads from `@file`, `-` (stdin) or JSON text: a JSON array, or JSON Lines (one object per line)."""
    text = sys.stdin.read() if source == "-" else Path(source[1:]).read_text() if source[0] == "@" else source
    try:
        if text.lstrip().startswith("["):
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"payloads are not a JSON array or JSON Lines: {exc}") from None
    if not isinstance(items, list) or not items:
        raise typer.BadParameter("expected at least one payload")
    return items
