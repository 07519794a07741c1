"""The renewal thread of one worker's `Leases` (`pipeline.delivery.lease`), and its clock: when the renewals last
succeeded, so when the worker may sweep."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("pipeline.delivery.lease")


class Leases(Protocol):
    """What the thread uses of `pipeline.delivery.lease.Leases`."""

    lease_seconds: float

    def renew_once(self, client: Any) -> set[str]: ...
    def renewed(self, ok: bool) -> None: ...
    def has_pending(self) -> bool: ...
    def ever_renewed(self) -> bool: ...
    def wait(self, delay: float) -> None: ...
    def wake(self) -> None: ...


class RenewalClock:
    """When this worker's renewals last succeeded, and what wakes its renewal thread (a base of `Leases`)."""

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = float(lease_seconds)
        self._clock = threading.Lock()
        self._streak_since: float | None = None  # monotonic time of the first renewal of the current unbroken run
        self._renewed_at: float | None = None  # monotonic time of the last successful renewal
        self._wake = threading.Event()

    def sweep_allowed(self) -> bool:
        """True once this worker's renewals have succeeded without a break for a whole lease (see
        `pipeline.delivery.lease`), the last one recently: a worker that was frozen renews (or finds its leases lost)
        before it sweeps."""
        with self._clock:
            now = time.monotonic()
            return (
                self._streak_since is not None
                and now - self._streak_since >= self.lease_seconds
                and self._renewed_at is not None
                and now - self._renewed_at <= self.lease_seconds / 2
            )

    def renewed(self, ok: bool) -> None:
        """Record a renewal's outcome: a failure, or a gap longer than the lease, starts the run over."""
        now = time.monotonic()
        with self._clock:
            if not ok or (self._renewed_at is not None and now - self._renewed_at > self.lease_seconds):
                self._streak_since = None
            if ok and self._streak_since is None:
                self._streak_since = now
            self._renewed_at = now if ok else None

    def wait(self, delay: float) -> None:
        """Sleep up to `delay` seconds, or until something is remembered for the renewal thread to write."""
        self._wake.wait(delay)
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def ever_renewed(self) -> bool:
        return self._renewed_at is not None


class Renewer:
    """The daemon thread renewing one worker's leases every LEASE_SECONDS/3 (and at once after a failure), until
    `stop`."""

    def __init__(self, leases: Leases, client_factory: Callable[[], Any]) -> None:
        self.leases = leases
        self._client_factory = client_factory
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-lease-renewer", daemon=True)

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.leases.wake()

    def _run(self) -> None:
        leases = self.leases
        period = leases.lease_seconds / 3
        client: Any = None
        while not self._stopped.is_set():
            delay = period
            try:
                client = client or self._client_factory()
                leases.renew_once(client)
                leases.renewed(True)
                delay = min(period, 1.0) if leases.has_pending() else period
            except Exception as exc:  # noqa: BLE001  # a connection error, Redis loading its AOF: try again soon
                if leases.ever_renewed():
                    log.warning("lease renewal failed (%r); retrying every second", exc)
                leases.renewed(False)
                client = None
                delay = 1.0
            leases.wait(delay)
