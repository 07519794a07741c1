"""Which transcode sources are acceptable: files inside MEDIA_ROOT, and http(s) URLs to public hosts.

Local paths are checked at enqueue and again on the worker: no `..`, and the real path (symlinks
followed) must be a file inside MEDIA_ROOT. URLs are checked in two steps by the SSRF guard
shared with webhooks (`tasks.netguard`): at enqueue without any network access (no literal
non-public address, no `localhost`), and on the worker just before ffmpeg runs, by resolving the host:
every address must be public. MEDIA_ALLOW_PRIVATE_URLS lifts the address rule (for in-cluster media
servers); name resolution failures are classified as the guard's docstring says. ffmpeg resolves the
name again and follows redirects, so this stops direct requests to internal services, not a hostile
DNS server; see docs/tasks.md.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from pipeline.config import get_settings
from tasks import netguard


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


def check_url(value: str) -> None:
    """Enqueue-time URL check (no network): a host, and not `localhost` or a non-public address literal."""
    host = urlsplit(value).hostname
    if not host:
        raise ValueError("source_uri URL has no host")
    if get_settings().media_allow_private_urls:
        return
    refusal = netguard.local_refusal(host)
    if refusal is not None:
        raise ValueError(f"source_uri must not point at a private address: {refusal}")


def resolve_public(url: str) -> netguard.Target:
    """Worker-time URL check (`netguard.vet`): every address of the host is public, unless
    MEDIA_ALLOW_PRIVATE_URLS; a name that does not resolve fails as the guard says."""
    return netguard.vet(url, allow_all=get_settings().media_allow_private_urls, setting="MEDIA_ALLOW_PRIVATE_URLS")
