"""The local backend: outputs as files under STORAGE_DIR, written to `.partial/` and renamed into place.

`key_for` maps back only the `file://` URIs `uri` produces (under the root, no `..`, no `.partial/`), and
`read_bytes` reads only regular files that resolve inside the root (a symlink out of it is not followed).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from pipeline.storage.base import ObjectTooLarge, Storage, StoredObject, check_key

#: Partial files of the local backend live here, on the same filesystem, so the final move is atomic.
PARTIAL_DIR = ".partial"


class LocalStorage(Storage):
    """Outputs as files under `root` (STORAGE_DIR)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        final = self.path(key)
        partial_dir = self.root / PARTIAL_DIR
        partial_dir.mkdir(parents=True, exist_ok=True)
        temp = partial_dir / f"{uuid.uuid4().hex}-{final.name}"
        try:
            yield temp
            if not temp.exists():
                raise FileNotFoundError(f"nothing was written for {key!r}")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)

    def read_lines(self, key: str) -> Iterator[bytes]:
        with self.path(key).open("rb") as lines:
            yield from lines

    def read_bytes(self, key: str, limit: int) -> bytes:
        path = self.path(key).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            raise FileNotFoundError(f"no stored object {key!r}")
        with path.open("rb") as stored:
            size = os.fstat(stored.fileno()).st_size
            if size > limit:
                raise ObjectTooLarge(key, limit, size)
            data = stored.read(limit + 1)
        if len(data) > limit:  # grew after the size was taken
            raise ObjectTooLarge(key, limit)
        return data

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def key_for(self, uri: str) -> str | None:
        root = self.root.as_uri()
        return self._key_after(root if root.endswith("/") else root + "/", uri)

    def delete(self, key: str) -> bool:
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):  # prune now-empty directories up to the root
            for parent in path.parents:
                if parent == self.root:
                    break
                parent.rmdir()
        return True

    def list(self, prefix: str = "") -> Iterator[StoredObject]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*")):
            rel = path.relative_to(self.root).as_posix()
            if rel.startswith(PARTIAL_DIR + "/") or rel == PARTIAL_DIR or not path.is_file():
                continue
            if rel.startswith(prefix):
                st = path.stat()
                yield StoredObject(rel, st.st_size, st.st_mtime)

    def purge_older_than(self, seconds: float) -> int:
        """Old outputs, plus partial files a killed process left behind."""
        removed = super().purge_older_than(seconds)
        cutoff = time.time() - seconds
        partial_dir = self.root / PARTIAL_DIR
        for temp in partial_dir.iterdir() if partial_dir.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                if temp.stat().st_mtime < cutoff:
                    temp.unlink()
                    removed += 1
        return removed
