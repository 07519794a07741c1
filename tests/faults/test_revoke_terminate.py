"""Celery's `revoke(terminate=True)` stops a running job on prefork and solo as `pipeline cancel` does: the job never
reaches its side effect, its state is REVOKED, its message is acknowledged and its lease gone, and it does not run
again in 2 x LEASE_SECONDS. The asyncio pool: `tests/faults/test_revoke_terminate_asyncio.py`.

Workers, jobs and the revoke: `tests.faults.revoking` (`celery worker`, REMAP_SIGTERM=SIGQUIT as the start scripts run
them, on the `default` queue of a Redis of the test's own, with a short lease; jobs record `start`, then `finish` after
their sleep, in the ledger).
"""

from __future__ import annotations

import pytest

from tests.faults.revoking import Rig, revoke_with_terminate_runs_never_again

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    ("kind", "task", "signal"),
    [
        ("prefork", "test.run", None),
        ("prefork", "test.run", "SIGTERM"),
        ("solo", "test.run", None),
        ("solo", "plain.run", None),
    ],
    ids=["prefork", "prefork-sigterm-as-flower-sends-it", "solo", "solo-celery-task"],
)
def test_revoke_with_terminate_stops_a_running_job_revoked_acknowledged_never_run_again(
    revoke_rig: Rig, kind: str, task: str, signal: str | None
) -> None:
    """Flower's terminate button sends SIGTERM, which pool processes ignore under REMAP_SIGTERM=SIGQUIT: the job is
    killed as a cancel kills it."""
    revoke_with_terminate_runs_never_again(revoke_rig, kind, task, signal)
