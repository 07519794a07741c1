"""Webhook signing, the SSRF guard's address rules, Retry-After parsing and response classes."""

from __future__ import annotations

import email.utils
import hashlib
import hmac

import httpx
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


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/",
        "http://10.1.2.3/",
        "http://192.168.0.1/",
        "http://172.16.5.4/",
        "http://169.254.169.254/latest/meta-data",
        "http://100.64.0.1/",
        "http://0.0.0.0/",
        "http://[::1]/",
        "http://[fd00::1]/",
        "http://[::ffff:10.0.0.1]/",
        "http://localhost/",
    ],
)
def test_non_public_addresses_are_refused(url: str) -> None:
    with pytest.raises(webhook_http.AddressRefused):
        webhook_http.vet(httpx.URL(url), [])


def test_allowlist_by_network_or_host_name() -> None:
    assert webhook_http.vet(httpx.URL("http://127.0.0.1:8080/x"), ["127.0.0.0/8"]).address == "127.0.0.1"
    target = webhook_http.vet(httpx.URL("http://localhost:8080/x"), ["localhost"])
    assert target.host == "localhost"
    assert target.port == 8080
    with pytest.raises(webhook_http.AddressRefused):
        webhook_http.vet(httpx.URL("http://10.0.0.1/"), ["127.0.0.0/8", "localhost"])


def test_public_address_passes_and_bad_schemes_are_permanent() -> None:
    assert webhook_http.vet(httpx.URL("https://93.184.216.34/"), []).port == 443
    with pytest.raises(PermanentError):
        webhook_http.vet(httpx.URL("ftp://93.184.216.34/"), [])


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
    response = httpx.Response(status, headers={"Retry-After": "3"})
    if kind is None:
        classify(response, "h")
        return
    with pytest.raises(kind) as caught:
        classify(response, "h")
    if status == 429:
        assert isinstance(caught.value, TransientError)
        assert caught.value.retry_after == 3.0
    assert not (kind is TransientError and isinstance(caught.value, PermanentError))
