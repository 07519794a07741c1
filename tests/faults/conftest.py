"""Every test here runs against the session's Redis and SMTP server (started on first use, see tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _services(services: None) -> None:
    """Start the session's Redis and SMTP server before the first test of this package."""
