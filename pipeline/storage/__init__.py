"""Where task outputs (PDFs, transcodes) are kept: `get_storage()` gives the backend STORAGE_BACKEND names.

`base.Storage` is the interface (write-then-rename, `uri` and its inverse `key_for`, a bounded `read_bytes`,
`list`, `purge_older_than`), `local.LocalStorage` keeps files under STORAGE_DIR, `s3.S3Storage` any
S3-compatible store (the `s3` extra).
"""

from __future__ import annotations

from functools import lru_cache

from pipeline.config import Settings, get_settings
from pipeline.storage.base import ObjectTooLarge, Storage, StoredObject, check_key
from pipeline.storage.local import LocalStorage

__all__ = ["LocalStorage", "ObjectTooLarge", "Storage", "StoredObject", "check_key", "get_storage", "make_storage"]


def make_storage(settings: Settings) -> Storage:
    """The backend STORAGE_BACKEND names, configured from `settings`."""
    if settings.storage_backend == "s3":
        from pipeline.storage.s3 import S3Storage  # boto3 only when configured

        return S3Storage.from_settings(settings)
    return LocalStorage(settings.storage_path)


@lru_cache(maxsize=1)
def get_storage() -> Storage:
    """The process's storage backend."""
    return make_storage(get_settings())
