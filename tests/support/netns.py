"""A worker "host" for tests: a network namespace joined to this machine by a veth pair, whose link can be cut.

`Host.create()` makes namespace `pl-<id>` and a veth pair from a private /30 of 10.231.0.0/16: `address` (its
first host) on this side, `inner_address` (its second) inside, loopback up in the namespace. A process started with
`prefix()` (`ip netns exec`, which execs the command: the PID is the process's own) reaches this machine only at
`address`: a redis-server bound to it is the namespace's broker, and `cut()` (this side's veth down: packets are
dropped, no error reaches either end, as on a partition) and `heal()` part and join them. `destroy()` deletes the
namespace and the veth (deleting either end deletes both); processes inside must be stopped by PID first. Traffic
goes only between the two ends of the pair.

Needs root and iproute2's `ip netns`: `require()` skips the test otherwise (CI runs as root).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
import uuid

import pytest

NETWORK = ipaddress.ip_network("10.231.0.0/16")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def require() -> None:
    """Skip unless this process can create network namespaces (root, iproute2 with `ip netns`)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs the suite as root)")
    if shutil.which("ip") is None or _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("iproute2's `ip netns` is not available")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of NETWORK no interface on this machine has an address in (tests in parallel each take their own)."""
    used = _ip("-4", "-o", "addr", "show").stdout
    blocks = list(NETWORK.subnets(new_prefix=30))
    random.shuffle(blocks)
    for block in blocks:
        if f" {block[1]}/" not in used:
            return block
    raise RuntimeError(f"no free /30 left in {NETWORK}")


class Host:
    """One network namespace and its veth pair (see the module doc)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.name = f"pl-{tag}"
        self.outer = f"vh{tag}"  # this side's end: interface names are at most 15 characters
        self.inner = f"vn{tag}"
        subnet = _free_subnet()
        self.address, self.inner_address = str(subnet[1]), str(subnet[2])
        self.created = False

    def create(self) -> Host:
        self.created = True
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _ip("link", "set", self.inner, "netns", self.name)
            _ip("addr", "add", f"{self.address}/30", "dev", self.outer)
            _ip("link", "set", self.outer, "up")
            _ip("-n", self.name, "addr", "add", f"{self.inner_address}/30", "dev", self.inner)
            _ip("-n", self.name, "link", "set", self.inner, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise RuntimeError(f"could not set up namespace {self.name}: {exc.stderr.strip()}") from exc
        return self

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        _ip("link", "set", self.outer, "down")

    def heal(self) -> None:
        _ip("link", "set", self.outer, "up")

    def destroy(self) -> None:
        if not self.created:
            return
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("netns", "delete", self.name, check=False)
            _ip("link", "delete", self.outer, check=False)  # gone with the namespace's end, unless never moved
        self.created = False
