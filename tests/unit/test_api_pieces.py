"""API pieces that need no services: settings, the development token, ETA parsing, pending states, strictness."""

from __future__ import annotations

import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI

from pipeline.api.enqueue import ETA_PATTERN, parse_eta
from pipeline.api.strict import documented_methods, operations_for
from pipeline.cli import stack as devstack
from pipeline.config import load_settings
from pipeline.errors import ConfigError
from pipeline.status import _pending_state


def test_a_short_api_token_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="API_TOKEN must be at least 16"):
        load_settings(api_token="short")  # noqa: S106  # a test value, not a secret
    assert load_settings(api_token="x" * 16).api_token is not None


def test_the_development_token_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    first = devstack.dev_api_token(settings)
    assert len(first) >= 16
    assert devstack.dev_api_token(settings) == first
    assert stat.S_IMODE((tmp_path / "api-token").stat().st_mode) == 0o600
    configured = load_settings(data_dir=tmp_path, api_token="configured-token-123")  # noqa: S106  # test value
    assert devstack.dev_api_token(configured) == "configured-token-123"
    banner = devstack._banner(configured, devstack.plan(configured, True), "configured-token-123")
    assert "configured-token-123" not in banner  # a configured secret is never printed


@pytest.mark.parametrize(
    "text", ["2030-01-31T12:00:00Z", "2030-01-31T12:00", "2030-01-31 12:00:00.123+02:00", "2030-01-31T12:00:00+0000"]
)
def test_eta_accepts_iso_times(text: str) -> None:
    assert ETA_PATTERN.match(text)
    assert parse_eta(text) == text


@pytest.mark.parametrize("text", ["0.5", "1700000000", "tomorrow", "2030-01-31", ""])
def test_eta_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_eta(text)


def test_pending_jobs_are_unknown_queued_or_scheduled_by_their_record() -> None:
    now = datetime.now(UTC)
    assert _pending_state(None) == "unknown"
    assert _pending_state({"eta": None}) == "queued"
    assert _pending_state({"eta": (now - timedelta(seconds=1)).isoformat()}) == "queued"
    assert _pending_state({"eta": (now + timedelta(minutes=1)).isoformat()}) == "scheduled"


def test_concrete_paths_win_over_templates_when_matching_requests() -> None:
    app = FastAPI()

    @app.post("/jobs/probe")
    def enqueue(delay_seconds: float | None = None) -> None: ...

    @app.get("/jobs/{job_id}")
    def status(job_id: str) -> None: ...

    @app.delete("/jobs/{job_id}")
    def remove(job_id: str, force: bool = False) -> None: ...

    assert operations_for(app, "/jobs/probe") == {"POST": {"delay_seconds"}}
    assert operations_for(app, "/jobs/abc") == {"GET": set(), "DELETE": {"force"}}
    assert documented_methods(app, "/jobs/abc/more") == set()
