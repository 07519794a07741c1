"""Every server-side script of the pipeline: one `.lua` file each in this package, loaded one way.

`script(name)` gives redis-py's `Script` for `<name>.lua` (read once per process): called with a client
(`script(name)(keys=[...], args=[...], client=client)`), it sends EVALSHA and, when Redis answers NOSCRIPT (a
restarted or a new server), loads the script and sends it again. A script that is sent raw, inside a poll cycle
(the worker's fetch), uses `sha(name)` and loads `source(name)` on NOSCRIPT itself.

Each file says at its top what it does and its KEYS and ARGV layout. Scripts are never built from fragments
at run time: a function two scripts share (`store`, writing a job's result) is written out in each, and a test
checks the copies are the same text (`tests/integration/test_lua_scripts.py`).
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

from redis.commands.core import Script


@cache
def source(name: str) -> bytes:
    """The text of `<name>.lua`."""
    return resources.files(__package__).joinpath(f"{name}.lua").read_bytes()


@cache
def sha(name: str) -> str:
    """The SHA-1 Redis names the script by (EVALSHA)."""
    return hashlib.sha1(source(name), usedforsecurity=False).hexdigest()


@cache
def script(name: str) -> Script:
    """redis-py's `Script` for `<name>.lua`, bound to no client: pass `client=` on every call."""
    return Script(None, source(name))  # type: ignore[arg-type]  # with bytes, no client is asked for an encoder


def names() -> list[str]:
    """Every script in the package."""
    return sorted(p.name[: -len(".lua")] for p in resources.files(__package__).iterdir() if p.name.endswith(".lua"))
