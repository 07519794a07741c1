"""prometheus-client's multiprocess directory for a worker node started by a plain `celery worker`.

A prefork worker's children count into files in `PROMETHEUS_MULTIPROC_DIR`, which the main process adds
up (`endpoint`). The start scripts (`deploy/docker/start-worker*`) set and wipe that directory before
Python starts. When it is not given and `METRICS_PORT` is set, `prepare()` makes one for the node.

Why this order works (prometheus-client 0.2x, `prometheus_client/values.py` and `metrics.py`):

* The library picks its value class once, when `prometheus_client.values` is imported
  (`ValueClass = get_value_class()`: `MultiProcessValue()` when the variable is in the environment, else
  in-memory `MutexValue`). Each metric *child* reads `values.ValueClass` when it is created.
* `pipeline.observability.metrics` declares its families at import, but every family has labels, and a
  labelled family holds no value until `.labels(...)` creates a child (`clear()` drops any).
* `prepare()` runs in `celeryd_init`: in the main process of `celery worker` only, sent from
  `Worker.on_before_init`, before the task modules are imported, logging is set up, a task runs or the
  pool forks. It creates the directory, puts it in `os.environ` (inherited by the children;
  `MultiProcessCollector` and `mark_process_dead` read it there), drops the families' children and
  installs `values.MultiProcessValue()`: what the library itself does at import when the variable is set.
  Every child created afterwards, in the main process or in a forked pool process, writes to the
  directory (`MultiProcessValue` notices the fork by PID and opens files of its own).

The directory is fresh (`tempfile.mkdtemp` under TMPDIR, named after the node and the PID, so two
nodes on one host never share one) and removed when the worker process exits. A worker killed with
SIGKILL leaves it behind; it holds a few small files and nothing else reads it.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client import values

from pipeline.config import get_settings
from pipeline.observability import metrics

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
#: Name prefix of the directories `prepare()` creates (under TMPDIR).
PREFIX = "pipeline-metrics-"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]")
_state: dict[str, Any] = {}


def directory() -> Path | None:
    """The multiprocess directory in use: the one `prepare()` made, or PROMETHEUS_MULTIPROC_DIR, or none."""
    prepared: Path | None = _state.get("dir")
    return prepared if prepared is not None else get_settings().prometheus_multiproc_dir


def prepare(node: str) -> Path | None:
    """Switch this worker node to multiprocess metrics in a fresh directory, when it needs one.

    A no-op without METRICS_PORT, with PROMETHEUS_MULTIPROC_DIR given, or when already done. Must run
    before the pool forks and before any metric child is created (see the module docstring).
    """
    settings = get_settings()
    if settings.metrics_port is None or settings.prometheus_multiproc_dir is not None or "dir" in _state:
        return directory()
    name = _UNSAFE.sub("_", node)[:80]
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{name}-{os.getpid()}-"))
    for family in metrics.FAMILIES:
        family.clear()  # before the switch: clearing in multiprocess mode only warns
    metrics.forget_children()
    os.environ[ENV_VAR] = str(path)
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # untyped
    _state["dir"] = path
    atexit.register(_remove, path, os.getpid())
    return path  # logged by the endpoint: logging is not set up yet in `celeryd_init`


def _remove(path: Path, owner: int) -> None:
    """Remove the directory, in the process that made it only (forked children inherit atexit hooks)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
