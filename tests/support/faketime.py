"""A skewed wall clock for a worker subprocess: libfaketime (Debian's `faketime` package) preloaded into it.

`skewed_env(offset_s, directory)` is the environment to add to a `Worker`'s: `LD_PRELOAD` of libfaketime with
`FAKETIME` an offset from the real time, so `time.time()` (CLOCK_REALTIME: what a host's wrong clock shows) is off by
`offset_s` in the worker and its pool processes, while the monotonic clock stays true
(`FAKETIME_DONT_FAKE_MONOTONIC=1`): Python waits on locks and events with `sem_clockwait(CLOCK_MONOTONIC)`, which
glibc hands the kernel as is, and a faked monotonic clock made them wait for ever.

libfaketime 0.9.10 (Debian 12) breaks Python 3.11's `time.sleep`, which sleeps with
`clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`: the library shifts that absolute deadline as if it were a wall-clock
time and the kernel answers EINVAL (wolfcw/libfaketime#426). The environment therefore also puts a `sitecustomize`
first on PYTHONPATH that makes `time.sleep` wait in `select()` with a relative timeout until the same monotonic
deadline. Only the sleep is replaced, in the test's worker processes; the wall clock the delivery layer reads is
libfaketime's.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu/faketime", "/usr/lib/aarch64-linux-gnu/faketime", "/usr/lib/faketime")

SITECUSTOMIZE = '''"""A test worker under libfaketime: time.sleep waits in select() (tests/support/faketime.py)."""

import select
import time

_monotonic = time.monotonic


def _sleep(seconds):
    deadline = _monotonic() + seconds
    while True:
        left = deadline - _monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


time.sleep = _sleep
'''


def library() -> str:
    """The path of libfaketime.so.1; the test fails (CI installs `faketime`: scripts/ensure-system-deps) if absent."""
    for directory in LIBRARY_DIRS:
        path = Path(directory) / "libfaketime.so.1"
        if path.exists():
            return str(path)
    pytest.fail("libfaketime is not installed (Debian package `faketime`: make system-deps)")


def skewed_env(offset_s: int, directory: Path) -> dict[str, str]:
    """Environment for a process whose wall clock is `offset_s` seconds off (negative: behind)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "LD_PRELOAD": library(),
        "FAKETIME": f"{offset_s:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
        "PYTHONPATH": path,
    }


def clock_offset(env: dict[str, str]) -> float:
    """How far `time.time()` is off in a Python started with `env` (checks the preload took)."""
    code = "import sys, time; t = float(sys.argv[1]); time.sleep(0.01); print(time.time() - t)"
    out = subprocess.run(
        [sys.executable, "-c", code, repr(time.time())],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return float(out.stdout)


def remove_shared(pids: list[int]) -> None:
    """Remove the shared memory and semaphore libfaketime made for each of `pids` (a process that exits cleanly
    removes its own; one killed leaves them in /dev/shm)."""
    for pid in pids:
        for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
            with contextlib.suppress(FileNotFoundError):
                (Path("/dev/shm") / name).unlink()
