"""email.send attachments: names and types checked at enqueue, reads bounded in total, parts after the body."""

from __future__ import annotations

import io
from email import message_from_bytes, policy
from email.message import EmailMessage
from pathlib import Path
from typing import Any, cast

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from pipeline.errors import PayloadInvalid, PermanentError, TransientError
from pipeline.storage import LocalStorage, get_storage
from pipeline.storage.s3 import S3Storage
from tasks.email import EmailJob, build_message, send
from tasks.email_attachments import (
    Attachment,
    AttachmentError,
    AttachmentUnavailable,
    Loaded,
    load,
    name_and_type,
)

WELCOME = {"name": "Ada", "product": "Pipeline", "action_url": "https://example.com/start"}


def job(*attachments: dict[str, Any]) -> dict[str, Any]:
    return {"to": ["ada@example.com"], "template_id": "welcome", "variables": WELCOME, "attachments": list(attachments)}


def stored(key: str = "pdf/job-1/invoice.pdf", **extra: Any) -> dict[str, Any]:
    return {"uri": get_storage().uri(key), **extra}  # the object need not exist to be enqueued


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"filename": "../invoice.pdf"}, "a filename is one name"),
        ({"filename": "a\\b.pdf"}, "a filename is one name"),
        ({"filename": "invoice\r\n.pdf"}, "a filename is one name"),
        ({"filename": "gpj.\u202eexe"}, "a filename is one name"),  # right-to-left override: a spoofed extension
        ({"filename": ".."}, "a filename is one name"),
        ({"filename": " invoice.pdf"}, "a filename is one name"),
        ({"filename": "x" * 201}, "at most 200 characters"),
        ({"content_type": "pdf"}, "type/subtype"),
        ({"content_type": "application/pdf; name=x.exe"}, "type/subtype"),
        ({"content_type": "text/html\r\nBcc: victim@example.com"}, "type/subtype"),
        ({"content_type": "multipart/mixed"}, "multipart/* or message/*"),
        ({"path": "/etc/passwd"}, "attachments.0.path"),
    ],
)
def test_bad_attachment_refused_at_enqueue(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadInvalid, match=r"attachments\.0") as info:
        send.enqueue(job(stored(**extra)))
    assert message in str(info.value)


def test_at_most_ten_attachments() -> None:
    with pytest.raises(PayloadInvalid, match="attachments: List should have at most 10 items"):
        send.enqueue(job(*[stored(f"pdf/{i}/a.pdf") for i in range(11)]))


def test_names_and_types_default_from_the_key() -> None:
    def named(key: str, **extra: Any) -> tuple[str, str]:
        return name_and_type(Attachment.model_validate(stored(key, **extra)), key)

    assert named("pdf/1/invoice.pdf") == ("invoice.pdf", "application/pdf")
    assert named("out/1/report.csv") == ("report.csv", "text/csv")
    assert named("out/1/notes") == ("notes", "application/octet-stream")
    assert named("out/1/logs.tar.gz") == ("logs.tar.gz", "application/octet-stream")  # not a bare tar
    assert named("pdf/1/a.pdf", filename="Rechnung März.pdf") == ("Rechnung März.pdf", "application/pdf")
    assert named("pdf/1/a.pdf", content_type="Application/X-Custom") == ("a.pdf", "application/x-custom")


def test_a_payload_survives_its_own_dump() -> None:
    """The worker validates the payload as enqueued: defaults dumped as null are accepted again."""
    parsed = EmailJob.model_validate(job(stored(), stored(filename="a.pdf", content_type="application/pdf")))
    assert EmailJob.model_validate(parsed.model_dump(mode="json")) == parsed
    assert parsed.model_dump()["attachments"][0] == {"uri": stored()["uri"], "filename": None, "content_type": None}


def test_parts_follow_the_body_as_attachments() -> None:
    parsed = EmailJob.model_validate(job())
    pdf = Loaded("Rechnung März.pdf", "application/pdf", b"%PDF-1.4\x00\xff binary")
    notes = Loaded("notes.txt", "text/plain", "über\r\n".encode())
    message = build_message(parsed, "key-1", [pdf, notes])
    wire = cast(EmailMessage, message_from_bytes(message.as_bytes(), policy=policy.default))
    assert wire.get_content_type() == "multipart/mixed"
    assert [p.get_content_type() for p in wire.iter_parts()] == [
        "multipart/alternative",
        "application/pdf",
        "text/plain",
    ]
    parts = list(wire.iter_attachments())
    assert [(p.get_filename(), p.get_content_disposition()) for p in parts] == [
        ("Rechnung März.pdf", "attachment"),
        ("notes.txt", "attachment"),
    ]
    assert [p.get_payload(decode=True) for p in parts] == [pdf.data, notes.data]
    assert wire["Message-ID"] == build_message(parsed, "key-1")["Message-ID"]  # attachments change nothing there


def test_attachments_are_capped_in_total(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for key, size in (("a/one.bin", 60), ("a/two.bin", 50)):
        with storage.open_write(key) as out:
            out.write(b"x" * size)
    one, two = (Attachment.model_construct(uri=storage.uri(k)) for k in ("a/one.bin", "a/two.bin"))
    assert [len(item.data) for item in load([one, two], 110, storage)] == [60, 50]
    with pytest.raises(
        AttachmentError, match=r"attachments\[1\] \(file://.*/a/two.bin\): 50 bytes, with the 60"
    ) as info:
        load([one, two], 109, storage)
    assert isinstance(info.value, PermanentError)
    assert "over EMAIL_ATTACHMENTS_MAX_BYTES (109 bytes in total)" in str(info.value)
    gone = Attachment.model_construct(uri=storage.uri("a/gone.pdf"))
    with pytest.raises(AttachmentError, match=r"attachments\[1\] .*a/gone.pdf\): no such stored object"):
        load([one, gone], 110, storage)


def test_a_failed_storage_read_is_transient_a_missing_object_permanent() -> None:
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")  # noqa: S106 - a stub
    storage, stub = S3Storage(client, "bucket", "outputs"), Stubber(client)
    attachment = Attachment.model_construct(uri="s3://bucket/outputs/pdf/1/invoice.pdf")
    data = b"%PDF-1.4"
    stub.add_client_error("get_object", "SlowDown", http_status_code=503)
    stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
    body = StreamingBody(io.BytesIO(data), len(data))
    stub.add_response("get_object", {"Body": body, "ContentLength": len(data)})
    with stub:
        with pytest.raises(AttachmentUnavailable, match="SlowDown") as info:
            load([attachment], 1000, storage)
        assert isinstance(info.value, TransientError)
        with pytest.raises(AttachmentError, match="no such stored object"):
            load([attachment], 1000, storage)
        assert load([attachment], 1000, storage) == [Loaded("invoice.pdf", "application/pdf", data)]
