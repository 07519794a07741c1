"""How `pipeline queues` shows Redis's memory: used against maxmemory, and a warning for a policy that evicts jobs."""

from __future__ import annotations

import pytest

from pipeline.broker import MemoryStats
from pipeline.cli.queues import memory_line


@pytest.mark.parametrize(
    ("memory", "line"),
    [
        (
            MemoryStats(10_276_044, 12 * 1024 * 1024, "noeviction"),
            "redis memory: 9.8 MiB of 12.0 MiB maxmemory (81.7%), policy noeviction",
        ),
        (MemoryStats(900, 0, "noeviction"), "redis memory: 900 B (no maxmemory set), policy noeviction"),
        (
            MemoryStats(3 * 1024**3, 4 * 1024**3, "allkeys-lru"),
            "redis memory: 3.0 GiB of 4.0 GiB maxmemory (75.0%), policy allkeys-lru",
        ),
    ],
)
def test_memory_line(memory: MemoryStats, line: str) -> None:
    assert memory_line(memory) == line


def test_only_noeviction_is_quiet() -> None:
    assert MemoryStats(1, 2, "noeviction").policy_warning is None
    for policy in ("allkeys-lru", "volatile-ttl", "allkeys-random"):
        warning = MemoryStats(1, 2, policy).policy_warning
        assert warning is not None and policy in warning and "noeviction" in warning


def test_ratio_is_none_without_a_limit() -> None:
    assert MemoryStats(5, 0, "noeviction").used_ratio is None
    assert MemoryStats(5, 10, "noeviction").used_ratio == 0.5
