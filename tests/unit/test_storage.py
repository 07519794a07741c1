"""Storage backends: write-then-rename, listing, ages and purge (local for real, S3 through botocore's Stubber)."""

from __future__ import annotations

import io
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber

from pipeline.config import load_settings
from pipeline.storage import LocalStorage, ObjectTooLarge, Storage, check_key, make_storage
from pipeline.storage.s3 import S3Storage


def test_local_write_is_renamed_into_place_only_when_complete(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.open_write("pdf/job-1/out.pdf") as out:
        out.write(b"%PDF-partial")
        assert not (tmp_path / "pdf/job-1/out.pdf").exists()  # still under a temporary name
        assert len(list((tmp_path / ".partial").iterdir())) == 1
    assert (tmp_path / "pdf/job-1/out.pdf").read_bytes() == b"%PDF-partial"
    assert list((tmp_path / ".partial").iterdir()) == []
    assert storage.uri("pdf/job-1/out.pdf") == (tmp_path / "pdf/job-1/out.pdf").resolve().as_uri()


def _crash_mid_write(storage: Storage, key: str) -> None:
    def write() -> None:
        with storage.open_write(key) as out:
            out.write(b"half")
            raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError, match="crash mid-write"):
        write()


def test_local_failed_write_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _crash_mid_write(storage, "a/b.bin")
    assert not (tmp_path / "a/b.bin").exists()
    assert list((tmp_path / ".partial").iterdir()) == []
    assert list(storage.list()) == []


def test_local_list_delete_and_purge(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for key in ("x/old.pdf", "x/new.pdf", "y/old.mp4"):
        with storage.open_write(key) as out:
            out.write(b"12345")
    old = time.time() - 7200
    os.utime(tmp_path / "x/old.pdf", (old, old))
    os.utime(tmp_path / "y/old.mp4", (old, old))
    stale_partial = tmp_path / ".partial" / "dead-worker.part"
    stale_partial.write_bytes(b"left by a killed process")
    os.utime(stale_partial, (old, old))

    assert [o.key for o in storage.list()] == ["x/new.pdf", "x/old.pdf", "y/old.mp4"]
    assert [o.key for o in storage.list("x/")] == ["x/new.pdf", "x/old.pdf"]
    stat = storage.stat("x/new.pdf")
    assert stat is not None
    assert stat.size == 5
    assert storage.purge_older_than(3600) == 3  # two outputs + the stale partial
    assert [o.key for o in storage.list()] == ["x/new.pdf"]
    assert not (tmp_path / "y").exists()  # emptied directories are pruned
    assert storage.delete("x/new.pdf") is True
    assert storage.delete("x/new.pdf") is False


@pytest.mark.parametrize("key", ["", "../etc/passwd", "/abs", "a/../b", "a//b", ".hidden", "a/b\\c", "a/ b"])
def test_unsafe_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="invalid storage key"):
        check_key(key)


def test_settings_choose_the_backend(tmp_path: Path) -> None:
    local = make_storage(load_settings(data_dir=tmp_path))
    assert isinstance(local, LocalStorage)
    assert local.root == (tmp_path / "storage").resolve()
    s3 = make_storage(load_settings(storage_backend="s3", s3_bucket="b", s3_prefix="p", s3_region="us-east-1"))
    assert isinstance(s3, S3Storage)
    assert s3.uri("k/v.pdf") == "s3://b/p/k/v.pdf"
    with pytest.raises(SystemExit, match="S3_BUCKET"):
        load_settings(storage_backend="s3")


def _stubbed() -> tuple[S3Storage, Stubber]:
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")  # noqa: S106 - a stub
    return S3Storage(client, "bucket", "outputs"), Stubber(client)


def test_s3_uploads_only_after_a_complete_write() -> None:
    storage, stub = _stubbed()
    expected = {"Bucket": "bucket", "Key": "outputs/pdf/1/a.pdf", "Body": ANY, "ChecksumAlgorithm": ANY}
    stub.add_response("put_object", {}, expected)
    with stub:
        _crash_mid_write(storage, "pdf/1/a.pdf")  # nothing uploaded: the stub fails on an unexpected call
        with storage.open_write("pdf/1/a.pdf") as out:
            out.write(b"%PDF-complete")
        stub.assert_no_pending_responses()


def test_s3_list_delete_purge() -> None:
    storage, stub = _stubbed()
    now, old = datetime.now(UTC), datetime.fromtimestamp(time.time() - 7200, UTC)
    listing = {
        "Contents": [
            {"Key": "outputs/a/old.pdf", "Size": 3, "LastModified": old},
            {"Key": "outputs/a/new.pdf", "Size": 4, "LastModified": now},
        ],
        "IsTruncated": False,
    }
    stub.add_response("list_objects_v2", listing, {"Bucket": "bucket", "Prefix": "outputs/"})
    stub.add_response("head_object", {}, {"Bucket": "bucket", "Key": "outputs/a/old.pdf"})
    stub.add_response("delete_object", {}, {"Bucket": "bucket", "Key": "outputs/a/old.pdf"})
    stub.add_client_error("head_object", "404", http_status_code=404)
    with stub:
        assert storage.purge_older_than(3600) == 1
        assert storage.delete("a/gone.pdf") is False
        stub.assert_no_pending_responses()


def test_open_write_streams(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.open_write("big.bin") as out:
        for _ in range(64):
            out.write(b"x" * 65536)
    assert io.FileIO(str(tmp_path / "big.bin")).readall() == b"x" * 65536 * 64


def test_read_lines_streams_a_stored_object() -> None:
    import io

    from botocore.response import StreamingBody

    storage, stub = _stubbed()
    data = b'[1, "a"]\n[2, "b"]\n'
    body = StreamingBody(io.BytesIO(data), len(data))
    stub.add_response("get_object", {"Body": body}, {"Bucket": "bucket", "Key": "outputs/inputs/rows.jsonl"})
    stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
    with stub:
        assert list(storage.read_lines("inputs/rows.jsonl")) == [b'[1, "a"]', b'[2, "b"]']
        with pytest.raises(FileNotFoundError):
            list(storage.read_lines("inputs/absent.jsonl"))


def test_local_read_lines(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.open_write("inputs/rows.jsonl") as out:
        out.write(b"[1]\n[2]\n")
    assert list(storage.read_lines("inputs/rows.jsonl")) == [b"[1]\n", b"[2]\n"]
    with pytest.raises(FileNotFoundError):
        list(storage.read_lines("inputs/absent.jsonl"))


def test_local_key_for_is_the_inverse_of_uri(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "dir with space")
    uri = storage.uri("pdf/job-1/invoice.pdf")
    assert "%20" in uri  # the root is percent-encoded; the key maps back all the same
    assert storage.key_for(uri) == "pdf/job-1/invoice.pdf"


@pytest.mark.parametrize(
    "tail",
    [
        "",  # the root itself
        "../outside.pdf",
        "pdf/../../outside.pdf",
        "pdf/%2e%2e/x.pdf",
        "pdf/./x.pdf",
        "pdf//x.pdf",
        ".partial/abc-x.pdf",
        "pdf/x.pdf?download=1",
        "pdf/x.pdf#page=2",
        "pdf/x%2Fy.pdf",
    ],
)
def test_local_key_for_refuses_what_uri_never_produces(tmp_path: Path, tail: str) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.key_for(tmp_path.resolve().as_uri() + "/" + tail) is None


@pytest.mark.parametrize(
    "uri",
    ["file:///etc/passwd", "/etc/passwd", "http://example.com/a.pdf", "s3://bucket/a.pdf", "", "pdf/a.pdf"],
)
def test_local_key_for_refuses_other_places(tmp_path: Path, uri: str) -> None:
    assert LocalStorage(tmp_path).key_for(uri) is None


def test_local_key_for_refuses_a_sibling_root_and_another_host(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    assert storage.key_for((tmp_path / "store-other" / "a.pdf").as_uri()) is None
    assert storage.key_for(storage.uri("a.pdf").replace("file:///", "file://localhost/")) is None


def test_local_read_bytes_is_bounded(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.open_write("pdf/1/a.pdf") as out:
        out.write(b"%PDF-1.4 twelve")
    assert storage.read_bytes("pdf/1/a.pdf", 15) == b"%PDF-1.4 twelve"
    with pytest.raises(ObjectTooLarge, match=r"'pdf/1/a.pdf' is 15 bytes; the limit is 14 bytes") as info:
        storage.read_bytes("pdf/1/a.pdf", 14)
    assert (info.value.size, info.value.limit) == (15, 14)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("pdf/1/absent.pdf", 100)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("pdf/1", 100)  # a directory is not an object


def test_local_read_bytes_refuses_a_huge_object_from_its_size(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.writing("big.bin") as path, path.open("wb") as out:
        out.truncate(1 << 40)  # 1 TiB, sparse: refused from its size, never read
    with pytest.raises(ObjectTooLarge, match=str(1 << 40)):
        storage.read_bytes("big.bin", 1 << 20)


def test_local_read_bytes_does_not_follow_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not for mail")
    storage = LocalStorage(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "link.txt").symlink_to(secret)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("link.txt", 100)


def test_s3_key_for_is_the_inverse_of_uri() -> None:
    storage, _ = _stubbed()
    assert storage.key_for("s3://bucket/outputs/pdf/1/a.pdf") == "pdf/1/a.pdf"
    for uri in (
        "s3://bucket/pdf/1/a.pdf",  # outside the prefix
        "s3://other/outputs/pdf/1/a.pdf",
        "s3://bucket/outputs/../secrets/a.pdf",
        "s3://bucket/outputs/pdf/1/a.pdf?versionId=1",
        "s3://bucket/outputs/",
        "https://bucket.s3.amazonaws.com/outputs/pdf/1/a.pdf",
        "file:///outputs/pdf/1/a.pdf",
    ):
        assert storage.key_for(uri) is None, uri
    assert S3Storage(storage.client, "bucket").key_for("s3://bucket/pdf/1/a.pdf") == "pdf/1/a.pdf"


def test_s3_read_bytes_is_bounded_and_classifies_failures() -> None:
    from botocore.response import StreamingBody

    storage, stub = _stubbed()
    data = b"%PDF-1.4 small"
    expected = {"Bucket": "bucket", "Key": "outputs/pdf/1/a.pdf"}
    for _ in range(2):
        body = StreamingBody(io.BytesIO(data), len(data))
        stub.add_response("get_object", {"Body": body, "ContentLength": len(data)}, expected)
    stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
    stub.add_client_error("get_object", "InternalError", http_status_code=500)
    with stub:
        assert storage.read_bytes("pdf/1/a.pdf", len(data)) == data
        with pytest.raises(ObjectTooLarge, match="the limit is 10 bytes"):
            storage.read_bytes("pdf/1/a.pdf", 10)
        with pytest.raises(FileNotFoundError):
            storage.read_bytes("pdf/1/absent.pdf", 100)
        with pytest.raises(ConnectionError, match="InternalError"):
            storage.read_bytes("pdf/1/a.pdf", 100)
        stub.assert_no_pending_responses()
