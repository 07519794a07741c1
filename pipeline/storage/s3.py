"""The S3-compatible storage backend (AWS, MinIO, R2, Ceph...): `STORAGE_BACKEND=s3`, needs the `s3` extra.

Outputs are written to a local temporary file, then uploaded with boto3's managed transfer (multipart
for large files). An S3 object becomes visible only when its upload completes, which gives the same
guarantee as the local backend's rename: no half object under the final key. `read_bytes` turns a missing
object into FileNotFoundError and a failed request (connection, timeout, 5xx, refused) into ConnectionError.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import Settings
from pipeline.storage.base import ObjectTooLarge, Storage, StoredObject, check_key

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


class S3Storage(Storage):
    def __init__(self, client: S3Client, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Storage:
        try:
            import boto3
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise RuntimeError("STORAGE_BACKEND=s3 needs boto3: pip install 'pipeline[s3]'") from exc
        secret = settings.s3_secret_access_key
        options: dict[str, Any] = {
            "endpoint_url": settings.s3_endpoint_url,
            "region_name": settings.s3_region,
            "aws_access_key_id": settings.s3_access_key_id,
            "aws_secret_access_key": secret.get_secret_value() if secret is not None else None,
        }
        client = boto3.client("s3", **{k: v for k, v in options.items() if v is not None})
        return cls(client, settings.s3_bucket or "", settings.s3_prefix)  # Settings refuses s3 without a bucket

    def object_key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        target = self.object_key(key)
        with tempfile.TemporaryDirectory(prefix="pipeline-s3-") as scratch:
            temp = Path(scratch) / Path(key).name
            yield temp
            if not temp.exists():
                raise FileNotFoundError(f"nothing was written for {key!r}")
            self.client.upload_file(str(temp), self.bucket, target)

    def read_lines(self, key: str) -> Iterator[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise FileNotFoundError(f"no stored object {key!r}") from None
        with contextlib.closing(body):
            yield from body.iter_lines()

    def read_bytes(self, key: str, limit: int) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError  # boto3 is installed when this backend is used

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))
            with contextlib.closing(response["Body"]) as body:
                if response["ContentLength"] > limit:
                    raise ObjectTooLarge(key, limit, response["ContentLength"])
                data = body.read(limit + 1)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"no stored object {key!r}") from None
            raise ConnectionError(f"reading {key!r} from s3://{self.bucket}: {exc}") from exc
        except BotoCoreError as exc:
            raise ConnectionError(f"reading {key!r} from s3://{self.bucket}: {exc}") from exc
        if len(data) > limit:
            raise ObjectTooLarge(key, limit)
        return data

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.object_key(key)}"

    def key_for(self, uri: str) -> str | None:
        return self._key_after(f"s3://{self.bucket}/{self.prefix}", uri)

    def delete(self, key: str) -> bool:
        target = self.object_key(key)
        try:
            self.client.head_object(Bucket=self.bucket, Key=target)
        except self.client.exceptions.ClientError:
            return False
        self.client.delete_object(Bucket=self.bucket, Key=target)
        return True

    def list(self, prefix: str = "") -> Iterator[StoredObject]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            for obj in page.get("Contents", []):
                yield StoredObject(
                    obj["Key"].removeprefix(self.prefix), int(obj["Size"]), obj["LastModified"].timestamp()
                )
