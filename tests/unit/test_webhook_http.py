"""Webhook signing, Retry-After parsing and response classes (the SSRF guard: test_netguard.py)."""

from __future__ import annotations

import email.utils
import hashlib
import hmac

import pytest

from pipeline.errors import PermanentError, TransientError
from tasks import webhook_http
from tasks.webhooks import classify, retry_after_s


def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    header = webhook_http.sign(b"k", 1700000000, b'{"a":1}')
    expected = hmac.new(b"k", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    assert webhook_http.verify(b"k", header, b'{"a":1}', now=1700000010)
    assert not webhook_http.verify(b"k", header, b'{"a":2}', now=1700000010)  # body changed
    assert not webhook_http.verify(b"k", header, b'{"a":1}', now=1700000000 + 301)  # too old: replay
    assert not webhook_http.verify(b"k", "garbage", b"")


def test_retry_after_seconds_and_http_date() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_s(date, now=1_000_000) == pytest.approx(30, abs=1)
    assert retry_after_s("999999999") == 24 * 3600.0


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, None),
        (204, None),
        (500, TransientError),
        (503, TransientError),
        (408, TransientError),
        (429, TransientError),
        (404, PermanentError),
        (400, PermanentError),
        (301, PermanentError),
    ],
)
def test_response_classes(status: int, kind: type[Exception] | None) -> None:
    response = webhook_http.Answer(status, "Reason", "3")
    if kind is None:
        classify(response, "h")
        return
    with pytest.raises(kind) as caught:
        classify(response, "h")
    if status == 429:
        assert isinstance(caught.value, TransientError)
        assert caught.value.retry_after == 3.0
    assert not (kind is TransientError and isinstance(caught.value, PermanentError))
