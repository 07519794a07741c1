"""Which transcode sources are acceptable: files inside MEDIA_ROOT, and http(s) URLs to public hosts.

Local paths are checked at enqueue and again on the worker: no `..`, and the real path (symlinks
followed) must be a file inside MEDIA_ROOT. URLs are checked in two steps: at enqueue without any
network access (no literal private/loopback address, no `localhost`), and on the worker just before
ffmpeg runs, by resolving the host: every address must be public. MEDIA_ALLOW_PRIVATE_URLS lifts the
address rule (for in-cluster media servers). ffmpeg resolves the name again and follows redirects,
so this stops direct requests to internal services, not a hostile DNS server; see README, "The tasks".
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from pipeline.config import get_settings
from pipeline.errors import PermanentError, TransientError


def is_remote(source: str) -> bool:
    return urlsplit(source).scheme in ("http", "https")


def local_source(value: str) -> Path:
    """The real path of a local source, if it is a file inside MEDIA_ROOT; else ValueError."""
    raw = value.removeprefix("file://")
    if ".." in PurePosixPath(raw).parts:
        raise ValueError("source_uri must not contain '..'")
    root = Path(os.path.realpath(get_settings().media_path))
    try:
        real = Path(os.path.realpath(root / raw))  # an absolute `raw` replaces root; symlinks are followed
        if not real.is_relative_to(root):
            raise ValueError(f"source_uri must resolve inside MEDIA_ROOT ({root})")
        if not real.is_file():
            raise ValueError(f"no such file under MEDIA_ROOT: {raw}")
    except OSError as exc:  # a name too long...: a bad payload, not a server error (found by the API fuzzing)
        raise ValueError(f"source_uri is not a usable path: {exc.strerror or exc}") from None
    return real


def _private(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return not ip.is_global or ip.is_multicast


def check_url(value: str) -> None:
    """Enqueue-time URL check (no network): a host, and not a private or loopback literal."""
    host = urlsplit(value).hostname
    if not host:
        raise ValueError("source_uri URL has no host")
    if get_settings().media_allow_private_urls:
        return
    if host == "localhost" or host.endswith(".localhost"):
        raise ValueError("source_uri must not point at localhost")
    try:
        private = _private(host)
    except ValueError:
        return  # a name: resolved on the worker
    if private:
        raise ValueError("source_uri must not point at a private, loopback or link-local address")


def resolve_public(url: str) -> None:
    """Worker-time URL check: every address of the host is public (PermanentError if not)."""
    if get_settings().media_allow_private_urls:
        return
    parts = urlsplit(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            raise TransientError(f"cannot resolve {parts.hostname} for now: {exc}") from exc
        raise PermanentError(f"cannot resolve {parts.hostname}: {exc}") from exc
    if any(_private(str(info[4][0])) for info in infos):
        raise PermanentError(f"{parts.hostname} resolves to a private address; refusing to fetch it")
