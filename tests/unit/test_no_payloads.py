"""Secrets are scrubbed by exact value, never by fragment; Celery's payload-carrying records are rewritten."""

from __future__ import annotations

import logging

import pytest
from celery.app import trace

from pipeline.config import load_settings
from pipeline.observability import payloads
from pipeline.observability.sentry import FILTERED, scrub_text, secret_values

DSN = "https://a1b2c3d4e5f6key@o42.ingest.example.io/7"


def test_secrets_are_exact_values_never_user_names_or_schemes() -> None:
    settings = load_settings(
        redis_url="redis://localhost:6379/1",
        flower_basic_auth="admin:s3cret,ops:other-pass",
        sentry_dsn=DSN,
        smtp_username="mailer",
        smtp_password="smtp:pass:word",  # noqa: S106  # a planted value
    )
    secrets = secret_values(settings)
    assert {"s3cret", "other-pass", "a1b2c3d4e5f6key", DSN, "smtp:pass:word"} <= set(secrets)
    for word in ("admin", "ops", "http", "https", "smtp", "pass", "word"):
        assert word not in secrets
    text = scrub_text(f"admin logged in from https://example.org with s3cret; dsn {DSN}; smtp:pass:word", secrets)
    assert "admin logged in from https://example.org" in text
    assert "s3cret" not in text and "a1b2c3d4e5f6key" not in text and "pass:word" not in text
    assert text.count(FILTERED) == 3


def test_a_url_secret_filters_its_password_not_its_user() -> None:
    secret = "https://hookuser:hookpass99@hooks.example/x"  # noqa: S105  # a planted value
    settings = load_settings(redis_url="redis://localhost:6379/1", webhook_signing_secret=secret)
    secrets = secret_values(settings)
    assert "hookpass99" in secrets and "hookuser" not in secrets


def _record(logger: str, msg: str, args: object) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, logging.INFO, __file__, 1, msg, args, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("log_payloads", [False, True])
def test_success_line_has_the_return_value_only_when_asked(log_payloads: bool) -> None:
    context = {"id": "t-1", "name": "pdf.render", "runtime": 0.5, "return_value": "{'uri': 'secret-doc'}", "args": "x"}
    record = _record("celery.app.trace", trace.LOG_SUCCESS, (context,))
    record.data = dict(context)
    payloads.CeleryPayloadFilter(log_payloads).filter(record)
    assert "pdf.render[t-1] succeeded in 0.5s" in record.getMessage()
    assert ("secret-doc" in record.getMessage()) is log_payloads
    assert set(record.data) == {"id", "name", "runtime"}, "extras never carry payloads"


def test_refused_message_line_names_the_entry_not_the_body() -> None:
    from celery.worker.consumer import consumer

    body = "(({'card': '4111-1111'},), {}, {})"
    args = (KeyError("no.such"), body, {"argsrepr": body}, {"routing_key": "default"})
    record = _record("celery.worker.consumer.consumer", consumer.UNKNOWN_TASK_ERROR, args)  # type: ignore[attr-defined]
    with payloads.refused_message("entry-42"):
        payloads.CeleryPayloadFilter(False).filter(record)
    message = record.getMessage()
    assert "4111" not in message and "dead-lettered as entry-42" in message and "no.such" in message

    kept = _record("celery.worker.consumer.consumer", consumer.UNKNOWN_TASK_ERROR, args)  # type: ignore[attr-defined]
    with payloads.refused_message("entry-43"):
        payloads.CeleryPayloadFilter(True).filter(kept)
    assert "4111" in kept.getMessage() and kept.getMessage().endswith("Dead-lettered as entry-43")


def test_other_records_pass_untouched() -> None:
    record = _record("celery.worker.consumer.consumer", "Connected to %s", ("redis://h",))
    assert payloads.CeleryPayloadFilter(False).filter(record)
    assert record.getMessage() == "Connected to redis://h"
