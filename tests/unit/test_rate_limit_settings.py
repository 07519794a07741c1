"""Per-worker rate limits: declared on a task, overridden from settings through Celery's annotations."""

from __future__ import annotations

import pytest
from celery import Celery

from pipeline.config import load_settings
from pipeline.config.celery import celery_conf
from pipeline.errors import ConfigError


def test_setting_overrides_the_rate_limit_a_task_declares() -> None:
    settings = load_settings(task_rate_limits={"ratetest.send": "100/m", "ratetest.render": "2.5/s"})
    app = Celery("rate-test", set_as_current=False)
    app.conf.update(celery_conf(settings))

    @app.task(name="ratetest.send", rate_limit="10/s", shared=False)
    def send() -> None: ...

    @app.task(name="ratetest.other", rate_limit="1/m", shared=False)
    def transcode() -> None: ...

    app.finalize()
    assert app.tasks["ratetest.send"].rate_limit == "100/m"
    assert app.tasks["ratetest.other"].rate_limit == "1/m"  # not overridden: its own declaration


@pytest.mark.parametrize("bad", ["100", "fast", "10/d", "-1/s"])
def test_malformed_rate_is_refused_at_start(bad: str) -> None:
    with pytest.raises(ConfigError, match="TASK_RATE_LIMITS"):
        load_settings(task_rate_limits={"email.send": bad})
