"""Settings that keep delays, retries and time limits inside the visibility timeout."""

from __future__ import annotations

import pytest

from pipeline.config import load_settings
from pipeline.errors import ConfigError


def test_worker_hold_limit_leaves_room_for_the_longest_run() -> None:
    settings = load_settings(
        visibility_timeout=1000,
        task_time_limit=300,
        task_soft_time_limit=200,
        transcode_time_limit=600,
        transcode_soft_time_limit=500,
        delayed_release_ahead=2,
    )
    assert settings.release_ahead == 2
    assert settings.worker_hold_limit == 1000 - 600 - 2
    # A retry that waits longer than this is parked rather than held by a worker (see PipelineTask).


SHORT = {
    "visibility_timeout": 4,
    "task_time_limit": 2,
    "task_soft_time_limit": 1,
    "transcode_time_limit": 2,
    "transcode_soft_time_limit": 1,
    "retry_max_delay": 0.5,
}


def test_release_ahead_is_capped_to_fit_the_visibility_timeout() -> None:
    assert load_settings(**SHORT, delayed_release_ahead=2).release_ahead == 1  # (4 - 2) / 2
    assert load_settings(**SHORT, delayed_release_ahead=0.5).release_ahead == 0.5
    settings = load_settings(**SHORT, delayed_release_ahead=1)
    assert settings.worker_hold_limit == 4 - 2 - 1


def test_webhook_settings() -> None:
    assert load_settings(webhook_signing_secret="").webhook_signing_secret is None
    with pytest.raises(ConfigError, match="WEBHOOK_SIGNING_SECRET"):
        load_settings(environment="production", webhook_signing_secret=None)
    with pytest.raises(ConfigError, match="WEBHOOK_ALLOWED_HOSTS"):
        load_settings(webhook_allowed_hosts=["10.0.0.0/33"])
    assert load_settings(webhook_allowed_hosts=["hooks.internal", "10.0.0.0/8"]).webhook_allowed_hosts
