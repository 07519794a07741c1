"""The sweep's first read: whether any lease in the index has lapsed, before the sweep takes its mutex.

A worker sweeps for lapsed leases every UNACKED_RESTORE_INTERVAL seconds (`pipeline.delivery.transport`,
`QoS.restore_visible`). Most sweeps find none, so the sweep first reads Redis's clock and the index's earliest
expiry in one round trip (`TIME`, `ZRANGE <index> 0 0 WITHSCORES`): a lease lapsed when its expiry is at or before
the clock, and when the earliest has not, none has, and the sweep ends there (no mutex taken, no range read). A
lease that lapses after this read is found by the next sweep, as one that lapses just after a full sweep is.
"""

from __future__ import annotations

from typing import Any


def lapsed_by(client: Any, index: str) -> float | None:
    """Redis's clock (seconds) when the earliest lease of `index` (its score an expiry on that clock) lapsed by then;
    None when none has."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrange(index, 0, 0, withscores=True)
    (seconds, micros), earliest = pipe.execute()
    now = float(seconds) + float(micros) / 1e6
    return now if earliest and float(earliest[0][1]) <= now else None
