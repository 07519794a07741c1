"""Where task outputs (PDFs, transcodes) are kept: a small interface, a local directory, and a factory.

Every write goes to a temporary name first and is moved under its final key only when it completed,
so a crash, a time limit or a revoke never leaves a half file under the final name::

    storage = get_storage()
    with storage.open_write("pdf/<id>/invoice.pdf") as out:     # a binary file object
        out.write(...)
    with storage.writing("media/<id>/out.mp4") as path:          # a local path, for tools like ffmpeg
        run_ffmpeg(..., path)
    storage.uri("pdf/<id>/invoice.pdf")                          # file:///... or s3://bucket/...
    storage.key_for(uri)                                         # the key back; None for any other URI
    storage.read_bytes("pdf/<id>/invoice.pdf", limit=10 << 20)   # whole object, ObjectTooLarge past limit

`purge_older_than(seconds)` removes outputs (and stale partial files) older than that; the nightly
artifact purge calls it. STORAGE_BACKEND selects `LocalStorage` (STORAGE_DIR) or the S3-compatible
`pipeline.storage.s3.S3Storage` (the `s3` extra).
"""

from __future__ import annotations

import contextlib
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


class ObjectTooLarge(ValueError):
    """A stored object is larger than a read's `limit` (`size` None: it grew past the limit while being read)."""

    def __init__(self, key: str, limit: int, size: int | None = None) -> None:
        super().__init__(key, limit, size)
        self.key, self.limit, self.size = key, limit, size

    def __str__(self) -> str:
        size = f"{self.size} bytes" if self.size is not None else "larger"
        return f"stored object {self.key!r} is {size}; the limit is {self.limit} bytes"


class StoredObject(NamedTuple):
    key: str
    size: int
    #: Last modification, epoch seconds.
    modified: float


def check_key(key: str) -> str:
    """`key` if it is a safe relative key (`a/b/c.pdf`: no `..`, no absolute path, no hidden parts)."""
    parts = key.split("/")
    if not key or len(key) > 1024 or not all(_SEGMENT.match(p) and p not in (".", "..") for p in parts):
        raise ValueError(f"invalid storage key {key!r}: use segments of letters, digits, '.', '_', '-'")
    return key


class Storage(ABC):
    """Write-then-rename storage of task outputs, addressed by relative keys."""

    @abstractmethod
    def writing(self, key: str) -> contextlib.AbstractContextManager[Path]:
        """A temporary local path to write; stored under `key` when the block ends without error, else removed."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """Where a stored object can be found (`file://` or `s3://`)."""

    @abstractmethod
    def key_for(self, uri: str) -> str | None:
        """The key whose `uri(key)` is `uri`; None for any URI this backend did not produce (another scheme,
        root or bucket, a `..`, a non-canonical spelling). Pure: no I/O."""

    @abstractmethod
    def read_bytes(self, key: str, limit: int) -> bytes:
        """The whole stored object, at most `limit` bytes: FileNotFoundError if there is none, ObjectTooLarge if
        it is larger (found out before reading past `limit`), another OSError if the backend could not be read
        (a connection, a timeout: worth retrying)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; False if it did not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[StoredObject]:
        """Every stored object whose key starts with `prefix`."""

    @abstractmethod
    def read_lines(self, key: str) -> Iterator[bytes]:
        """The stored object's lines, streamed (FileNotFoundError if there is none)."""

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        """A binary file to stream into; stored under `key` only if the block completes."""
        with self.writing(key) as path, path.open("wb") as out:
            yield out

    def _key_after(self, prefix: str, uri: str) -> str | None:
        """`uri` minus `prefix` if that is a valid key whose `uri()` is exactly `uri`, else None."""
        if not uri.startswith(prefix):
            return None
        key = uri[len(prefix) :]
        try:
            check_key(key)
        except ValueError:
            return None
        return key if self.uri(key) == uri else None

    def stat(self, key: str) -> StoredObject | None:
        return next((o for o in self.list(key) if o.key == key), None)

    def purge_older_than(self, seconds: float) -> int:
        """Delete objects last modified more than `seconds` ago; return how many were removed."""
        cutoff = time.time() - seconds
        return sum(1 for obj in list(self.list()) if obj.modified < cutoff and self.delete(obj.key))
