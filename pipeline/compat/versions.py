"""The version guard: the installed celery, kombu, billiard, celery-redbeat and redis-py against the versions the
seam was verified on.

Every reach into a library's internals (`pipeline.compat.ENTRIES`, `pipeline.delivery.ENTRIES`) was written and
tested against the versions in `VERIFIED`. The installed versions are read from the distributions' metadata
(`importlib.metadata`), never from a copy in the code. Outside the verified versions nothing runs silently:

* a speed-only replacement is left off (`enabled` is False: Celery's or kombu's own path runs) with one WARNING
  naming the library, its version and the verified ones, whatever ALLOW_UNVERIFIED_VERSIONS says;
* a process that depends on one for delivery (the worker's transport, beat's scheduler, the producer of the API
  and the CLI) refuses to start (`require`): one line on stderr naming the library, the installed and the verified
  versions and how to proceed, exit status 2 — unless ALLOW_UNVERIFIED_VERSIONS=true accepts the risk (then one
  WARNING, and the process starts with its delivery code on).

`make upgrade-check` runs the parity and fault tiers against the newest versions the ranges in `pyproject.toml`
allow; once they pass, the new versions go into `VERIFIED` and the lock (README, "Upgrading a dependency").
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

#: Distribution name → the versions every entry of the seam was verified on (the parity and fault tiers passed).
VERIFIED: dict[str, str] = {
    "celery": "==5.7.0",
    "kombu": "==5.7.0",
    "billiard": "==4.3.2",
    "celery-redbeat": "==2.4.2",
    "redis": "==8.1.0",
}

#: Exit status of a process that refuses to start (a usage error, as for a bad setting).
EX_REFUSED = 2
_accepted: set[str] = set()  # what `require` let start on unverified versions (warned once each)


@dataclass(frozen=True)
class Entry:
    """One reach into a library's internals: what it replaces or reads, where, on which libraries, and the test that
    proves, against upstream at test time, that it still matches."""

    #: The upstream symbol(s), e.g. "kombu.transport.redis.Channel._brpop_start".
    upstream: str
    #: The project module that holds it.
    where: str
    #: The distributions it depends on (keys of `VERIFIED`).
    libraries: tuple[str, ...]
    #: The parity test, as a pytest node id ("tests/unit/test_x.py::test_y").
    test: str
    #: False: speed only, left off outside the verified versions; True: the process refuses to start there.
    critical: bool = False


@dataclass(frozen=True)
class Mismatch:
    """A library installed at a version the seam was not verified on."""

    distribution: str
    installed: str
    verified: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.installed} (verified: {self.verified})"


def installed(distribution: str) -> str:
    """The installed version of `distribution`, from its metadata ("missing" when it is not installed)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "missing"


def _matches(version: str, specifier: str) -> bool:
    try:
        return Version(version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def mismatches(distributions: Iterable[str]) -> list[Mismatch]:
    """The libraries among `distributions` installed outside their verified versions."""
    found = []
    for name in distributions:
        version = installed(name)
        if not _matches(version, VERIFIED[name]):
            found.append(Mismatch(name, version, VERIFIED[name]))
    return found


@cache
def enabled(replacement: str, distributions: tuple[str, ...]) -> bool:
    """Whether the speed-only `replacement` may run: every library it reaches into is a verified version. Logs one
    WARNING per replacement when not (Celery's or kombu's own path runs instead)."""
    found = mismatches(distributions)
    if found:
        log.warning(
            "%s left off: %s; the library's own code runs instead (`make upgrade-check` verifies this version)",
            replacement,
            ", ".join(map(str, found)),
        )
    return not found


def require(what: str, distributions: Iterable[str], allow_unverified: bool) -> None:
    """Refuse to start `what` (exit status 2, one line on stderr) when a library it depends on for delivery is
    installed outside its verified versions, unless `allow_unverified` (ALLOW_UNVERIFIED_VERSIONS) accepts the risk."""
    found = mismatches(distributions)
    if not found:
        return
    named = ", ".join(map(str, found))
    if allow_unverified:
        if what not in _accepted:  # beat builds its scheduler twice (the banner's, then the one that runs)
            _accepted.add(what)
            log.warning("%s runs on unverified versions (ALLOW_UNVERIFIED_VERSIONS=true): %s", what, named)
        return
    print(
        f"pipeline: refusing to start the {what}: {named}. Its delivery guarantees were verified only on those"
        " versions. Run `make upgrade-check` to test this version (then widen pipeline.compat.versions.VERIFIED),"
        " install the locked versions (`make install`), or set ALLOW_UNVERIFIED_VERSIONS=true to accept the risk.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EX_REFUSED)


def reset() -> None:
    """Forget which replacements were checked and which processes were warned about (tests)."""
    enabled.cache_clear()
    _accepted.clear()
