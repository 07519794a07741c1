"""The version guard: the installed celery, kombu, billiard, celery-redbeat, redis-py and flower against the ranges
the seam was verified on.

Every reach into a library's internals (`pipeline.compat.ENTRIES`, `pipeline.delivery.ENTRIES`) was written and
tested against the libraries in `GUARDED`, on the versions `verified()` names. Those ranges have one source, the
project's own requirements in `pyproject.toml` (`"redis>=8.1,<8.3"`): read back from it in a source tree, else from
the installed project's metadata (`importlib.metadata.requires`), they are what pip may install and what the guard
accepts, so a plain `pip install` never resolves a version the guard refuses. A range spans whole minor series,
each verified on its newest patch: a patch release inside it is accepted the day it ships; a new minor or major is
taken through `make upgrade-check`, which runs the parity and fault tiers on it and widens the range in
`pyproject.toml` when they pass. The installed versions are read from the distributions' metadata too, never from a
copy in the code. Outside the verified ranges nothing runs silently (a `pip install -U kombu` into the same
environment, another project's requirements, an install with `--no-deps`):

* a speed-only replacement is left off (`enabled` is False: Celery's or kombu's own path runs) with one WARNING
  naming the library, its version and the verified ones, whatever ALLOW_UNVERIFIED_VERSIONS says;
* a process that depends on one for delivery (the worker's transport, beat's scheduler, the producer of the API
  and the CLI) refuses to start (`require`): one line on stderr naming the library, the installed and the verified
  versions and how to proceed, exit status 2 — unless ALLOW_UNVERIFIED_VERSIONS=true accepts the risk (then one
  WARNING, and the process starts with its delivery code on).

docs/upgrading.md says how a range widens.
"""

from __future__ import annotations

import logging
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from packaging.requirements import Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

#: The distributions the seam reaches into; pyproject.toml bounds each one on both sides (tests/unit/test_compat.py).
GUARDED = ("celery", "kombu", "billiard", "celery-redbeat", "redis", "flower")
#: This project's distribution name, whose requirements hold the verified ranges.
PROJECT = "pipeline"
#: What a guarded library the project's requirements do not name is verified on: nothing (never a valid specifier).
UNDECLARED = "(not declared in pyproject.toml)"
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

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
    #: The distributions it depends on (names in `GUARDED`).
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


def declared() -> list[str]:
    """The project's runtime requirements: `pyproject.toml` beside the package when run from its source tree (an
    editable install, a checkout; an `*.egg-info` a build left there may be stale), else the installed metadata."""
    if _PYPROJECT.is_file():
        project = tomllib.loads(_PYPROJECT.read_text()).get("project", {})
        if project.get("name") == PROJECT:
            return list(project.get("dependencies", []))
    return metadata.requires(PROJECT) or []


def ranges(requirements: Iterable[str]) -> dict[str, str]:
    """GUARDED name -> the specifier `requirements` give it (those of an extra left out), UNDECLARED when none."""
    found: dict[str, str] = {}
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name in GUARDED and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            found[name] = ",".join(filter(None, [found.get(name), str(requirement.specifier)]))
    return {name: found.get(name) or UNDECLARED for name in GUARDED}


@cache
def verified() -> dict[str, str]:
    """GUARDED name -> the range the seam was verified on, e.g. ">=8.1,<8.3": the project's declared requirements."""
    return ranges(declared())


def _matches(version: str, specifier: str) -> bool:
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False


def mismatches(distributions: Iterable[str]) -> list[Mismatch]:
    """The libraries among `distributions` installed outside their verified ranges."""
    found = []
    for name in distributions:
        version, wanted = installed(name), verified()[name]
        if not _matches(version, wanted):
            found.append(Mismatch(name, version, wanted))
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
    refuse(
        f"the {what}: {named}. Its delivery guarantees were verified only on those"
        " versions. Run `make upgrade-check` to test this version (it widens the range in pyproject.toml when the tests"
        " pass), install the locked versions (`make install`), or set ALLOW_UNVERIFIED_VERSIONS=true to accept the"
        " risk."
    )


def refuse(reason: str) -> NoReturn:
    """Refuse to start: one line on stderr, "pipeline: refusing to start <reason>", and exit status 2."""
    print(f"pipeline: refusing to start {reason}", file=sys.stderr, flush=True)
    raise SystemExit(EX_REFUSED)


def reset() -> None:
    """Forget which replacements were checked and which processes were warned about (tests)."""
    enabled.cache_clear()
    _accepted.clear()
