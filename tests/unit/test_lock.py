"""The lock files are the versions in use: installed here, agreeing with each other and with pyproject.toml's ranges,
and what the Docker image and `make install` install (with their hashes).

Each check is a function over plain data, run on the real files and also shown to fail on a small wrong case.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEV_LOCK = ROOT / "requirements-dev.lock"
RUNTIME_LOCK = ROOT / "requirements.lock"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    marker: Marker | None
    hashes: int

    def applies(self) -> bool:
        """Whether this interpreter and platform install it (a universal lock also pins for other platforms)."""
        return self.marker is None or self.marker.evaluate()


def parse_lock(text: str) -> list[Pin]:
    """The pins of a pip requirements file: `name==version [; marker] \\` and the `--hash=` lines under it."""
    entries: list[list[str]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line[0].isspace() and entries:
            entries[-1].append(stripped)
        else:
            entries.append([stripped])
    pins = []
    for entry in entries:
        joined = " ".join(part.rstrip("\\").strip() for part in entry)
        spec, *options = re.split(r"\s+(?=--hash=)", joined)
        requirement = Requirement(spec)
        versions = [s.version for s in requirement.specifier if s.operator == "=="]
        assert len(versions) == 1 and len(requirement.specifier) == 1, f"not an exact pin: {spec!r}"
        hashes = sum(1 for option in options if re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", option))
        pins.append(Pin(canonicalize_name(requirement.name), versions[0], requirement.marker, hashes))
    return pins


def versions(pins: list[Pin]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for pin in pins:
        found.setdefault(pin.name, set()).add(pin.version)
    return found


def installed_mismatches(pins: list[Pin], installed: dict[str, str]) -> list[str]:
    """Pins that apply here but are missing or at another version in `installed` (canonical name -> version)."""
    problems = []
    for pin in pins:
        if not pin.applies():
            continue
        have = installed.get(pin.name)
        if have is None:
            problems.append(f"{pin.name}=={pin.version} is not installed")
        elif Version(have) != Version(pin.version):
            problems.append(f"{pin.name}=={pin.version} is installed at {have}")
    return problems


def subset_mismatches(runtime: list[Pin], dev: list[Pin]) -> list[str]:
    """Runtime pins that the dev lock lacks or pins at other versions."""
    dev_versions = versions(dev)
    return [
        f"{name} {sorted(vs)} in the runtime lock, {sorted(dev_versions.get(name, set()))} in the dev lock"
        for name, vs in sorted(versions(runtime).items())
        if not vs <= dev_versions.get(name, set())
    ]


def range_mismatches(requirements: list[str], pins: list[Pin]) -> list[str]:
    """pyproject.toml requirements (that apply here) missing from the lock or pinned outside their specifier."""
    locked = versions(pins)
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in locked:
            problems.append(f"{text!r} is not in the lock")
            continue
        outside = [v for v in locked[name] if not requirement.specifier.contains(v, prereleases=True)]
        if outside:
            problems.append(f"{text!r} is locked at {', '.join(sorted(outside))}")
    return problems


def installed_distributions() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dependencies() -> tuple[list[str], list[str], list[str]]:
    """pyproject.toml's runtime requirements, its dev extra and its build requirements."""
    project = pyproject()
    runtime = project["project"]["dependencies"]
    dev = project["project"]["optional-dependencies"]["dev"]
    build = project["build-system"]["requires"]
    return runtime, dev, build


def dockerfile_runs() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # continued lines joined
    return [" ".join(match.split()) for match in re.findall(r"^RUN (.*)$", text, re.M)]


def pip_installs(runs: list[str]) -> list[str]:
    """Each `pip install ...` of the image's RUN lines, up to the next `&&`."""
    return [part.strip() for run in runs for part in run.split("&&") if re.search(r"\bpip install\b", part)]


def unlocked_installs(installs: list[str]) -> list[str]:
    """pip installs that resolve versions themselves: neither the hashed runtime lock nor a --no-deps install."""
    locked = re.compile(r"--require-hashes\b.*-r requirements\.lock\b|-r requirements\.lock\b.*--require-hashes\b")
    return [cmd for cmd in installs if not locked.search(cmd) and "--no-deps" not in cmd.split()]


# --- the real files -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev_pins() -> list[Pin]:
    return parse_lock(DEV_LOCK.read_text())


@pytest.fixture(scope="module")
def runtime_pins() -> list[Pin]:
    return parse_lock(RUNTIME_LOCK.read_text())


def test_locks_pin_every_package_with_hashes(dev_pins: list[Pin], runtime_pins: list[Pin]) -> None:
    assert len(versions(runtime_pins)) > 20 and len(versions(dev_pins)) > len(versions(runtime_pins))
    assert [p.name for p in dev_pins + runtime_pins if p.hashes == 0] == []
    for lock in (DEV_LOCK, RUNTIME_LOCK):
        assert "#    make lock" in lock.read_text().splitlines()[1], f"{lock.name} is written by `make lock`"


def test_every_dev_lock_pin_is_installed_here_at_that_version(dev_pins: list[Pin]) -> None:
    assert installed_mismatches(dev_pins, installed_distributions()) == [], "run `make install`"


def test_runtime_lock_is_the_dev_lock_s_versions(dev_pins: list[Pin], runtime_pins: list[Pin]) -> None:
    assert subset_mismatches(runtime_pins, dev_pins) == []


def test_pyproject_requirements_are_locked_within_their_ranges(dev_pins: list[Pin], runtime_pins: list[Pin]) -> None:
    runtime, dev, build = dependencies()
    assert range_mismatches(runtime + build, runtime_pins) == []
    assert range_mismatches(runtime + dev + build, dev_pins) == []


def test_the_uv_that_compiles_the_locks_is_the_locked_one(dev_pins: list[Pin]) -> None:
    _, dev, _ = dependencies()
    pinned = [Requirement(r) for r in dev if canonicalize_name(Requirement(r).name) == "uv"]
    assert len(pinned) == 1 and str(pinned[0].specifier).startswith("=="), "the dev extra pins uv exactly"
    assert versions(dev_pins)["uv"] == {str(pinned[0].specifier)[2:]}


def test_dockerfile_installs_the_runtime_lock_with_hashes_then_only_the_project() -> None:
    installs = pip_installs(dockerfile_runs())
    assert any("--require-hashes" in cmd and "-r requirements.lock" in cmd for cmd in installs), installs
    assert unlocked_installs(installs) == []
    assert re.search(r"^COPY requirements\.lock ", DOCKERFILE.read_text(), re.M)


def test_make_install_installs_the_dev_lock_with_hashes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):(.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert rule, "the install stamp rule"
    assert "$(DEV_LOCK)" in rule.group(1).split() and "pyproject.toml" in rule.group(1).split()
    assert re.search(r"^DEV_LOCK\s*:=\s*requirements-dev\.lock$", makefile, re.M)
    installs = [line.strip() for line in rule.group(2).splitlines() if "pip install" in line]
    assert any("--require-hashes" in cmd and "-r $(DEV_LOCK)" in cmd for cmd in installs), installs
    assert all("--require-hashes" in cmd or "--no-deps" in cmd.split() for cmd in installs), installs


# --- the checks catch what they are for ---------------------------------------------------------------------

LOCK = """\
# This file was autogenerated by uv via the following command:
#    make lock
Kombu==5.7.0 \\
    --hash=sha256:{h}
    # via celery
redis==8.1.0 ; sys_platform != 'nowhere' \\
    --hash=sha256:{h} \\
    --hash=sha256:{h}
colorama==0.4.6 ; sys_platform == 'nowhere' \\
    --hash=sha256:{h}
""".format(h="0" * 64)


def test_parse_lock_reads_names_versions_markers_and_hashes() -> None:
    pins = {p.name: p for p in parse_lock(LOCK)}
    assert {n: (p.version, p.hashes, p.applies()) for n, p in pins.items()} == {
        "kombu": ("5.7.0", 1, True),
        "redis": ("8.1.0", 2, True),
        "colorama": ("0.4.6", 1, False),
    }
    with pytest.raises(AssertionError, match="not an exact pin"):
        parse_lock("redis>=8\n")


def test_a_pin_mismatch_is_reported() -> None:
    pins = parse_lock(LOCK)
    assert installed_mismatches(pins, {"kombu": "5.7.0", "redis": "8.1.0"}) == []
    assert installed_mismatches(pins, {"kombu": "5.7.1"}) == [
        "kombu==5.7.0 is installed at 5.7.1",
        "redis==8.1.0 is not installed",
    ]


def test_a_runtime_pin_the_dev_lock_disagrees_with_is_reported() -> None:
    dev = parse_lock(LOCK)
    assert subset_mismatches(parse_lock("kombu==5.7.0\n"), dev) == []
    assert subset_mismatches(parse_lock("kombu==5.7.1\nvine==5.1.0\n"), dev) == [
        "kombu ['5.7.1'] in the runtime lock, ['5.7.0'] in the dev lock",
        "vine ['5.1.0'] in the runtime lock, [] in the dev lock",
    ]


def test_a_requirement_locked_outside_its_range_or_missing_is_reported() -> None:
    pins = parse_lock(LOCK)
    assert range_mismatches(["kombu>=5.7,<5.8", "redis>=5.2,<9", "nothing; python_version < '3'"], pins) == []
    assert range_mismatches(["kombu>=5.8", "redis<8", "celery>=5.7"], pins) == [
        "'kombu>=5.8' is locked at 5.7.0",
        "'redis<8' is locked at 8.1.0",
        "'celery>=5.7' is not in the lock",
    ]


def test_an_image_install_that_resolves_by_itself_is_reported() -> None:
    good = ["pip install --require-hashes --no-deps -r requirements.lock", "pip install --no-deps ."]
    assert unlocked_installs(good) == []
    assert unlocked_installs(["pip install --no-compile .", "pip install -r requirements.lock"]) == [
        "pip install --no-compile .",
        "pip install -r requirements.lock",
    ]
