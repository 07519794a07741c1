"""Attachments of `email.send`: objects of the pipeline's own storage backend, named by the URI it gave them.

An `Attachment` names a URI that `Storage.uri()` produced (a `pdf.render` result's `uri`, say). Any other
URI (another scheme, root or bucket, a `..`, a `file:///etc/passwd`, an http URL) is refused when the
payload is validated, so a job can never mail an arbitrary file or fetch a URL. On the worker, `load()`
reads the objects, bounded by EMAIL_ATTACHMENTS_MAX_BYTES in total: a missing object or one past the cap is
an `AttachmentError` (permanent: the job is dead-lettered and nothing is sent), a read that failed for now
(a storage connection) an `AttachmentUnavailable` (transient: retried). `attach()` adds them to the message
as attachment parts after its text and HTML alternatives (which makes it multipart/mixed).
"""

from __future__ import annotations

import mimetypes
import re
from collections.abc import Sequence
from dataclasses import dataclass
from email.message import EmailMessage
from functools import lru_cache
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import PermanentError, TransientError
from pipeline.storage import ObjectTooLarge, Storage, get_storage

MAX_ATTACHMENTS = 10
MAX_FILENAME = 200
DEFAULT_CONTENT_TYPE = "application/octet-stream"
#: `type/subtype` of RFC 6838's restricted names, lowercase, no parameters.
CONTENT_TYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}$")
#: Containers of other parts: sent base64-encoded they would not be what they claim.
REFUSED_MAINTYPES = ("multipart", "message")


class NotAttached(Exception):
    """Marker base: an attachment could not be read, so nothing was sent."""


class AttachmentError(PermanentError, NotAttached):
    """An attachment's object is missing, or the attachments are over EMAIL_ATTACHMENTS_MAX_BYTES."""


class AttachmentUnavailable(TransientError, NotAttached):
    """The storage backend could not be read for now (connection, timeout, 5xx)."""


def _one_name(name: str) -> str:
    if name in (".", "..") or name != name.strip() or any(c in "/\\" or not c.isprintable() for c in name):
        raise ValueError(
            "a filename is one name: no '/' or '\\', no line breaks, control or format characters, "
            "no leading or trailing space"
        )
    return name


def _type_subtype(content_type: str) -> str:
    lowered = content_type.lower()
    if not CONTENT_TYPE.match(lowered):
        raise ValueError("a content type is type/subtype, e.g. application/pdf (no parameters)")
    if lowered.partition("/")[0] in REFUSED_MAINTYPES:
        raise ValueError("an attachment cannot be multipart/* or message/*")
    return lowered


#: One file name (no `/` or `\`, no control characters); null, as a payload dumped with its defaults gives it, is
#: the default.
FileName = Annotated[str, Field(min_length=1, max_length=MAX_FILENAME), AfterValidator(_one_name)]
#: `type/subtype`, lowercased.
ContentType = Annotated[str, Field(min_length=3, max_length=255), AfterValidator(_type_subtype)]


class Attachment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: A URI the pipeline's storage backend produced, e.g. a `pdf.render` result's `uri`.
    uri: str = Field(min_length=1, max_length=2048)
    #: Default: the last part of the object's key.
    filename: FileName | None = None
    #: Default: guessed from the filename, else `application/octet-stream`.
    content_type: ContentType | None = None

    @field_validator("uri")
    @classmethod
    def _in_storage(cls, uri: str) -> str:
        if get_storage().key_for(uri) is None:
            raise ValueError(
                "not an object of the pipeline's storage backend: give a URI the storage produced, "
                "such as a pdf.render result's uri"
            )
        return uri


@dataclass(frozen=True)
class Loaded:
    """An attachment read from storage, ready for the message."""

    filename: str
    content_type: str
    data: bytes


@lru_cache(maxsize=1)
def _types() -> mimetypes.MimeTypes:
    """Python's own table only (not the host's /etc/mime.types), so every host guesses alike."""
    return mimetypes.MimeTypes()


def name_and_type(attachment: Attachment, key: str) -> tuple[str, str]:
    """The attachment's filename and content type, defaults filled in from its key."""
    filename = attachment.filename or key.rpartition("/")[2]
    if attachment.content_type:
        return filename, attachment.content_type
    guessed, encoding = _types().guess_type(filename)
    # `x.tar.gz` guesses as application/x-tar with gzip encoding: the bytes are not a tar, so say nothing.
    return filename, guessed if guessed and not encoding else DEFAULT_CONTENT_TYPE


def load(attachments: Sequence[Attachment], max_bytes: int, storage: Storage | None = None) -> list[Loaded]:
    """Read every attachment, `max_bytes` in total at most; AttachmentError / AttachmentUnavailable naming it."""
    if not attachments:
        return []
    storage = get_storage() if storage is None else storage
    loaded: list[Loaded] = []
    total = 0
    for index, attachment in enumerate(attachments):
        label = f"attachments[{index}] ({attachment.uri})"
        key = storage.key_for(attachment.uri)
        if key is None:  # the storage settings changed since the job was enqueued
            raise AttachmentError(f"{label}: not an object of the configured storage backend")
        try:
            data = storage.read_bytes(key, max_bytes - total)
        except FileNotFoundError:
            raise AttachmentError(f"{label}: no such stored object (deleted, or removed by the purge)") from None
        except ObjectTooLarge as exc:
            size = f"{exc.size} bytes" if exc.size is not None else f"more than {exc.limit} bytes"
            before = f", with the {total} bytes attached before it," if total else ""
            raise AttachmentError(
                f"{label}: {size}{before} is over EMAIL_ATTACHMENTS_MAX_BYTES ({max_bytes} bytes in total)"
            ) from None
        except OSError as exc:
            raise AttachmentUnavailable(f"{label}: reading the storage failed: {exc}") from exc
        total += len(data)
        loaded.append(Loaded(*name_and_type(attachment, key), data))
    return loaded


def attach(message: EmailMessage, attachments: Sequence[Loaded]) -> None:
    """Add each as an attachment part (Content-Disposition: attachment; filename) after the message's body."""
    for item in attachments:
        maintype, _, subtype = item.content_type.partition("/")
        message.add_attachment(item.data, maintype=maintype, subtype=subtype, filename=item.filename)
