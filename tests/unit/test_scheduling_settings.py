"""Settings for delays, retries and leases."""

from __future__ import annotations

import pytest

from pipeline.config import load_settings
from pipeline.errors import ConfigError


def test_a_worker_holds_every_backoff_the_retry_policy_computes() -> None:
    """A live worker renews the lease of every message it holds, so only RETRY_MAX_DELAY bounds a held wait;
    a longer one (a Retry-After) is parked rather than held (see PipelineTask)."""
    settings = load_settings(retry_max_delay=600, delayed_release_ahead=2, transcode_time_limit=10800)
    assert settings.release_ahead == 2
    assert settings.worker_hold_limit == 600
    assert load_settings(retry_max_delay=1, retry_base_delay=0.5, delayed_release_ahead=3).worker_hold_limit == 3


def test_lease_seconds_is_validated() -> None:
    assert load_settings().lease_seconds == 30
    with pytest.raises(ConfigError, match="LEASE_SECONDS"):
        load_settings(lease_seconds=4)
    # Time limits no longer bound the lease: a three-hour transcode runs under a 30 s lease, renewed.
    assert load_settings(lease_seconds=5, transcode_soft_time_limit=10000, transcode_time_limit=10800)


def test_webhook_settings() -> None:
    assert load_settings(webhook_signing_secret="").webhook_signing_secret is None
    with pytest.raises(ConfigError, match="WEBHOOK_SIGNING_SECRET"):
        load_settings(environment="production", webhook_signing_secret=None)
    with pytest.raises(ConfigError, match="WEBHOOK_ALLOWED_HOSTS"):
        load_settings(webhook_allowed_hosts=["10.0.0.0/33"])
    assert load_settings(webhook_allowed_hosts=["hooks.internal", "10.0.0.0/8"]).webhook_allowed_hosts
