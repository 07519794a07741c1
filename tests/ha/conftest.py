"""The high-availability tier: real topologies (a primary, a replica and three Sentinels; worker hosts in network
namespaces; skewed clocks; a Redis at maxmemory) started by the tests themselves and stopped by PID. Each test
counts jobs sent against jobs run from a ledger of its own, as the fault tier does."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ha


@pytest.fixture(autouse=True)
def _services(services: None) -> None:
    """The session's Redis and SMTP server up (ledgers and embedded helpers use them)."""
