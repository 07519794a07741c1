"""The installed library versions taken as verified for one block, so that a parity test runs the replacement.

A speed-only replacement is left off on a version outside `pipeline.compat.versions.verified()` (`compat.enabled`).
The parity tier also runs on versions not verified yet (`make upgrade-check`, which is how they get verified): a
test that needs a replacement installed, not just called, runs it inside `verified_as_installed()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.compat import serialization, versions


@contextmanager
def verified_as_installed() -> Iterator[None]:
    """Inside the block, every installed library counts as verified (and the checks made so far are forgotten)."""
    ranges = versions.verified()  # the cached mapping every check reads
    saved = dict(ranges)
    for name in saved:
        version = versions.installed(name)
        if version != "missing":
            ranges[name] = f"=={version}"
    _forget()
    try:
        yield
    finally:
        ranges.update(saved)
        _forget()


def _forget() -> None:
    versions.reset()
    serialization.decoder.cache_clear()
