"""Every server-side script of the pipeline: one `.lua` file per entry point in this package, loaded one way.

`script(name)` gives redis-py's `Script` for `<name>.lua` (assembled once per process): called with a client
(`script(name)(keys=[...], args=[...], client=client)`), it sends EVALSHA and, when Redis answers NOSCRIPT (a
restarted or a new server, a promoted replica), loads the script and sends it again. A script that is sent raw,
inside a poll cycle (the worker's fetch), uses `sha(name)` and loads `source(name)` on NOSCRIPT itself.

Each entry file says what it does, then includes the helpers it shares, then defines its entry point as a named
function (`local function fetch(KEYS, ARGV)`) with its KEYS, ARGV and reply written at its head, and ends by
calling it. A helper two scripts share (`store`, writing a job's result; `acknowledge`; a flow node's `record`) is
written once, in `parts/<part>.lua`, and a line `--- @include "<part>"` in a script puts its text there when the
script is assembled, as BullMQ builds its scripts (each part once per script, parts may include parts). Why an
include and not one Redis Functions library: docs/operations.md ("Server-side scripts").
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources

from redis.commands.core import Script

#: A line that includes a part: `--- @include "results"` (leading spaces allowed).
INCLUDE = re.compile(rb'^[ \t]*--- @include "([a-z_]+)"[ \t]*$', re.M)


def _file(path: str) -> bytes:
    return resources.files(__package__).joinpath(path).read_bytes()


def _assemble(text: bytes, seen: set[bytes]) -> bytes:
    """`text` with each include line replaced by its part's text (assembled in turn); a part seen already: nothing."""

    def part(match: re.Match[bytes]) -> bytes:
        name = match.group(1)
        if name in seen:
            return b""
        seen.add(name)
        return _assemble(_file(f"parts/{name.decode()}.lua"), seen).rstrip(b"\n")

    return INCLUDE.sub(part, text)


@cache
def source(name: str) -> bytes:
    """The text Redis runs for `<name>.lua`: the file with its parts included."""
    return _assemble(_file(f"{name}.lua"), set())


@cache
def sha(name: str) -> str:
    """The SHA-1 Redis names the script by (EVALSHA)."""
    return hashlib.sha1(source(name), usedforsecurity=False).hexdigest()


@cache
def script(name: str) -> Script:
    """redis-py's `Script` for `<name>.lua`, bound to no client: pass `client=` on every call."""
    return Script(None, source(name))  # type: ignore[arg-type]  # with bytes, no client is asked for an encoder


def names() -> list[str]:
    """Every script in the package (its entry points; the parts in `parts/` are not scripts)."""
    return sorted(p.name[: -len(".lua")] for p in resources.files(__package__).iterdir() if p.name.endswith(".lua"))


def parts() -> list[str]:
    """Every shared part in `parts/`."""
    folder = resources.files(__package__).joinpath("parts")
    return sorted(p.name[: -len(".lua")] for p in folder.iterdir() if p.name.endswith(".lua"))
