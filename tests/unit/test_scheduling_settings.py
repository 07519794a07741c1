"""Settings that keep delays, retries and time limits inside the visibility timeout."""

from __future__ import annotations

import pytest

from pipeline.config import load_settings
from pipeline.errors import ConfigError


def test_retry_wait_plus_time_limit_must_fit_in_the_visibility_timeout() -> None:
    with pytest.raises(ConfigError, match="RETRY_MAX_DELAY"):
        load_settings(visibility_timeout=400, task_time_limit=300, task_soft_time_limit=200, retry_max_delay=100)
    ok = load_settings(visibility_timeout=450, task_time_limit=300, task_soft_time_limit=200, retry_max_delay=100)
    assert ok.retry_max_delay == 100


SHORT = {"visibility_timeout": 4, "task_time_limit": 2, "task_soft_time_limit": 1, "retry_max_delay": 0.5}


def test_release_ahead_plus_time_limit_must_fit_in_the_visibility_timeout() -> None:
    with pytest.raises(ConfigError, match="DELAYED_RELEASE_AHEAD"):
        load_settings(**SHORT, delayed_release_ahead=2)
    settings = load_settings(**SHORT, delayed_release_ahead=1)
    assert settings.visibility_timeout == 4


def test_webhook_settings() -> None:
    assert load_settings(webhook_signing_secret="").webhook_signing_secret is None
    with pytest.raises(ConfigError, match="WEBHOOK_SIGNING_SECRET"):
        load_settings(environment="production", webhook_signing_secret=None)
    with pytest.raises(ConfigError, match="WEBHOOK_ALLOWED_HOSTS"):
        load_settings(webhook_allowed_hosts=["10.0.0.0/33"])
    assert load_settings(webhook_allowed_hosts=["hooks.internal", "10.0.0.0/8"]).webhook_allowed_hosts
