"""Signal handlers: a failure inside one is logged and counted, never silently swallowed."""

from __future__ import annotations

import logging

import pytest

from pipeline.observability import metrics
from pipeline.runtime import signals


def test_guarded_handler_logs_and_counts_its_errors(caplog: pytest.LogCaptureFixture) -> None:
    @signals.guarded
    def on_something(**_: object) -> None:
        raise RuntimeError("broken handler")

    counter = metrics.signal_handler_errors.labels(handler="on_something")
    before = counter._value.get()
    with caplog.at_level(logging.ERROR, logger="pipeline.runtime.signals"):
        on_something(sender=None)
    assert counter._value.get() == before + 1
    assert "signal handler on_something failed" in caplog.text
    assert "broken handler" in caplog.text


def test_publish_header_is_stamped_once() -> None:
    headers: dict[str, object] = {}
    signals.on_before_task_publish(headers=headers)
    first = headers["pipeline_published_at"]
    signals.on_before_task_publish(headers=headers)
    assert headers["pipeline_published_at"] == first


def test_install_is_idempotent_and_uninstall_disconnects() -> None:
    from celery import signals as celery_signals

    signals.install()
    signals.install()

    def ours() -> list[object]:
        return [r for r in celery_signals.task_failure.receivers if r[0][0] == "pipeline.on_task_failure"]

    assert len(ours()) == 1
    signals.uninstall()
    assert ours() == []
    signals.install()
