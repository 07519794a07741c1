"""The worker's heartbeat file and the liveness verdict read from it (`pipeline worker-health`).

The worker's stall watchdog (`pipeline.runtime.stall`) rewrites one small JSON file per worker node,
`<WORKER_HEALTH_DIR>/pipeline-worker-<node>.health`, from its event loop every few seconds:

    {"at": 1764590000.5, "state": "ok" | "stalled" | "stopping", "reason": "...", "stale_after": 60.0, ...}

A probe needs no network port: it reads the file. The worker is unhealthy when the file is missing, when it
was last written more than `stale_after` seconds ago (the event loop has stopped: nothing else writes it),
or when its state is `stalled` (queued jobs not fetched; the reason says which). `stopping` (a soft shutdown
in progress, which blocks the loop on purpose) counts as healthy until its own `stale_after` (the soft shutdown
timeout plus STALL_TIMEOUT) has passed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OK = "ok"
STALLED = "stalled"
STOPPING = "stopping"


def _safe(node: str, keep: str = "@._-") -> str:
    return "".join(c if c.isalnum() or c in keep else "_" for c in node)


def health_path(directory: Path, node: str) -> Path:
    """The heartbeat file of worker node `node` (e.g. `celery@host`)."""
    return directory / f"pipeline-worker-{_safe(node)}.health"


def health_paths(directory: Path, node: str) -> list[Path]:
    """The heartbeat files of `node`, or of every node a glob matches (`io*@host`); at least one path."""
    if "*" not in node:
        return [health_path(directory, node)]
    found = sorted(directory.glob(f"pipeline-worker-{_safe(node, '@._-*')}.health"))
    return found or [health_path(directory, node.replace("*", ""))]


def write_heartbeat(path: Path, state: str, reason: str | None, stale_after: float, **extra: Any) -> None:
    """Replace the heartbeat file atomically (a probe never reads half a file)."""
    record = {"at": time.time(), "state": state, "reason": reason, "stale_after": stale_after, **extra}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reason: str
    record: dict[str, Any] | None


def check_heartbeat(path: Path, now: float | None = None) -> Verdict:
    """Whether the worker that writes `path` is alive and consuming, and why not."""
    try:
        record = json.loads(path.read_text())
        at = float(record["at"])
        stale_after = float(record["stale_after"])
        state = str(record["state"])
    except FileNotFoundError:
        return Verdict(False, f"no heartbeat file {path} (the worker has not started, or runs as another node)", None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Verdict(False, f"unreadable heartbeat file {path}: {exc}", None)
    age = (time.time() if now is None else now) - at
    if age > stale_after:
        return Verdict(
            False, f"heartbeat stale: last written {age:.0f} s ago (the worker's event loop is not running)", record
        )
    if state == STOPPING:
        return Verdict(True, "stopping (soft shutdown in progress)", record)
    if state != OK:
        return Verdict(False, str(record.get("reason") or state), record)
    return Verdict(True, "healthy", record)
