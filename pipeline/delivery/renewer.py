"""The renewal thread of one worker's `Leases` (`pipeline.delivery.lease`)."""

from __future__ import annotations

import logging
import threading
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
