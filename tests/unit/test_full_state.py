"""A worker's view of a full Redis (`pipeline.delivery.full.FullState`): one line per state change, one per write
skipped; and when Redis counts as full (`pipeline.broker.MemoryStats.full`), as the exporter and the workers read it."""

from __future__ import annotations

import logging

import pytest

from pipeline.broker import MemoryStats
from pipeline.delivery import full

REFUSAL = Exception("command not allowed when used memory > 'maxmemory'.")


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.delivery.transport"]


def test_each_state_change_and_each_write_skipped_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    state = full.FullState()
    with caplog.at_level(logging.INFO, logger="pipeline.delivery.transport"):
        for _ in range(3):
            state.refused("the binding of a queue", REFUSAL)
            state.refused("the wait for new jobs", REFUSAL)
        assert state.full
        state.room()
        state.room()
        state.refused("the binding of a queue", REFUSAL)
    lines = said(caplog)
    assert sum(line.startswith("Redis is at maxmemory (") for line in lines) == 2  # full, room, full again
    assert sum(line.startswith("Redis has room again") for line in lines) == 1
    skipped = [line for line in lines if "skipped until it has room" in line]
    assert len(skipped) == 3 and all("maxmemory" in line for line in skipped)  # two, then one after the change


def test_room_is_looked_for_at_most_every_check_interval_and_only_while_full() -> None:
    state = full.FullState()
    assert not state.check_due()  # not full: nothing to look for
    state.refused("a write", REFUSAL)
    assert state.check_due()
    assert not state.check_due()  # within ROOM_CHECK_S
    state.checked_at -= full.ROOM_CHECK_S
    assert state.check_due()


@pytest.mark.parametrize(
    ("used", "limit", "uncounted", "is_full"),
    [(100, 0, 0, False), (100, 100, 0, False), (101, 100, 0, True), (120, 100, 30, False)],
)
def test_redis_is_full_above_maxmemory_as_redis_counts(used: int, limit: int, uncounted: int, is_full: bool) -> None:
    info = {"used_memory": used, "maxmemory": limit, "maxmemory_policy": "noeviction"}
    stats = MemoryStats.from_info({**info, "mem_not_counted_for_evict": uncounted})
    assert stats.full is is_full
