"""The heartbeat file's verdict (`pipeline worker-health`): fresh and ok, stale, stalled, stopping, missing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from kombu.utils.imports import symbol_by_name

from pipeline.config import load_settings
from pipeline.delivery.fencing import DeliveryStep
from pipeline.errors import ConfigError
from pipeline.observability.health import OK, STALLED, STOPPING, check_heartbeat, health_path, write_heartbeat
from pipeline.runtime.stall import StallWatchdog, heartbeat_interval


def test_fresh_ok_heartbeat_is_healthy(tmp_path: Path) -> None:
    path = health_path(tmp_path, "io@host-1")
    assert path.name == "pipeline-worker-io@host-1.health"
    write_heartbeat(path, OK, None, 60)
    verdict = check_heartbeat(path)
    assert verdict.healthy and verdict.reason == "healthy"
    assert not list(tmp_path.glob(".*.tmp")), "written atomically, nothing left behind"


def test_stale_heartbeat_means_the_event_loop_stopped(tmp_path: Path) -> None:
    path = health_path(tmp_path, "io@host")
    write_heartbeat(path, OK, None, 60)
    verdict = check_heartbeat(path, now=time.time() + 61)
    assert not verdict.healthy and verdict.reason.startswith("heartbeat stale: last written 61 s ago")


def test_stalled_heartbeat_carries_its_reason(tmp_path: Path) -> None:
    path = health_path(tmp_path, "io@host")
    write_heartbeat(path, STALLED, "queued jobs not fetched: 3 in email", 60)
    verdict = check_heartbeat(path)
    assert not verdict.healthy and verdict.reason == "queued jobs not fetched: 3 in email"


def test_stopping_is_healthy_until_its_own_bound(tmp_path: Path) -> None:
    path = health_path(tmp_path, "cpu@host")
    write_heartbeat(path, STOPPING, "soft shutdown in progress", 660)
    assert check_heartbeat(path, now=time.time() + 600).healthy
    assert not check_heartbeat(path, now=time.time() + 700).healthy


def test_missing_or_garbled_file_is_unhealthy(tmp_path: Path) -> None:
    path = health_path(tmp_path, "io@host")
    assert "no heartbeat file" in check_heartbeat(path).reason
    path.write_text(json.dumps({"state": "ok"}))
    verdict = check_heartbeat(path)
    assert not verdict.healthy and "unreadable heartbeat file" in verdict.reason


def test_node_names_cannot_escape_the_directory(tmp_path: Path) -> None:
    assert health_path(tmp_path, "../../etc/x@h").parent == tmp_path


def test_stall_timeout_is_validated_and_sets_the_heartbeat_pace() -> None:
    assert load_settings(redis_url="redis://localhost:6379/1").stall_timeout == 60
    with pytest.raises(ConfigError, match="STALL_TIMEOUT"):
        load_settings(redis_url="redis://localhost:6379/1", stall_timeout=0)
    assert heartbeat_interval(60) == 5.0 and heartbeat_interval(3) == 0.75 and heartbeat_interval(1) == 0.5


def _requirements(step: Any) -> set[str]:
    """Every bootstep `step` requires, directly or not, as `module.Class`."""
    found: set[str] = set()
    for required in step.requires:
        cls = symbol_by_name(required) if isinstance(required, str) else required
        found |= {f"{cls.__module__}.{cls.__name__}"} | _requirements(cls)
    return found


@pytest.mark.parametrize("step", [StallWatchdog, DeliveryStep])
def test_steps_whose_threads_connect_at_once_start_after_the_pool_forks(step: Any) -> None:
    # A prefork child forked while another thread is inside OpenSSL (rediss://) inherits OpenSSL's locks
    # held and hangs at its own first TLS connection. Without the requirement the boot order is left to the
    # bootstep graph, which put such a step on either side of the pool from one start to the next.
    assert "celery.worker.components.Pool" in _requirements(step)
