"""`pipeline worker` without `--processes`: one solo worker per CPU the process may use, plus one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.cli.workers import default_processes, quota_cpus

CPUS = len(os.sched_getaffinity(0))


def _v2(root: Path, text: str) -> Path:
    root.mkdir(exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def _v1(root: Path, quota: int, period: int = 100000) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


@pytest.mark.parametrize(("text", "cpus"), [("150000 100000\n", 2), ("50000 100000\n", 1), ("400000 100000\n", 4)])
def test_a_cgroup_v2_quota_gives_its_cpus_rounded_up(tmp_path: Path, text: str, cpus: int) -> None:
    assert quota_cpus(_v2(tmp_path, text)) == cpus


def test_a_cgroup_v1_quota_gives_its_cpus_rounded_up(tmp_path: Path) -> None:
    assert quota_cpus(_v1(tmp_path, 250000)) == 3


@pytest.mark.parametrize("text", ["max 100000\n", "garbage\n", ""])
def test_no_v2_quota(tmp_path: Path, text: str) -> None:
    assert quota_cpus(_v2(tmp_path, text)) is None


def test_no_v1_quota_and_no_cgroup(tmp_path: Path) -> None:
    assert quota_cpus(_v1(tmp_path / "v1", -1)) is None
    assert quota_cpus(tmp_path / "none") is None


def test_the_default_is_the_cpus_plus_one_and_a_lower_quota_wins(tmp_path: Path) -> None:
    assert default_processes(tmp_path / "none") == CPUS + 1
    assert default_processes(_v2(tmp_path / "one", "100000 100000\n")) == 2
    assert default_processes(_v2(tmp_path / "many", f"{100000 * (CPUS + 8)} 100000\n")) == CPUS + 1
