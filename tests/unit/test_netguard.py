"""The SSRF guard shared by webhooks and media sources: address rules, allowlists, DNS failure classes."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from pipeline.config import get_settings
from pipeline.errors import PermanentError, TransientError
from tasks import media_sources, netguard


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
        "http://[::]/",
        "http://[fd00::1]/",
        "http://[fe80::1]/",
        "http://[::ffff:10.0.0.1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:169.254.169.254]/",
        "http://[64:ff9b::7f00:1]/",  # NAT64 form of 127.0.0.1
        "http://[2002:a00:1::1]/",  # 6to4 form of 10.0.0.1
        "http://localhost/",
    ],
)
def test_non_public_addresses_are_refused(url: str) -> None:
    with pytest.raises(netguard.AddressRefused, match="not a public address"):
        netguard.vet(url, [])


def test_allowlist_by_network_or_host_name() -> None:
    assert netguard.vet("http://127.0.0.1:8080/x", ["127.0.0.0/8"]).address == "127.0.0.1"
    assert netguard.vet("http://10.20.3.4/x", ["10.20.0.0/16"]).address == "10.20.3.4"
    assert netguard.vet("http://[::1]/x", ["::1/128"]).address == "::1"
    target = netguard.vet("http://localhost:8080/x", ["localhost"])
    assert target.host == "localhost"
    assert target.port == 8080
    assert not netguard.is_public(ipaddress.ip_address(target.address))
    with pytest.raises(netguard.AddressRefused):
        netguard.vet("http://10.0.0.1/", ["127.0.0.0/8", "localhost"])
    with pytest.raises(netguard.AddressRefused):
        netguard.vet("http://10.21.0.1/", ["10.20.0.0/16"])


def test_allow_all_accepts_any_address_but_still_resolves() -> None:
    assert netguard.vet("http://127.0.0.1:9/", allow_all=True).address == "127.0.0.1"
    assert netguard.vet("http://[::ffff:10.0.0.1]/", allow_all=True).port == 80


def test_public_addresses_pass_and_bad_urls_are_permanent() -> None:
    assert netguard.vet("https://93.184.216.34/", []).port == 443
    assert netguard.vet("http://[::ffff:93.184.216.34]:8080/").address == "::ffff:5db8:d822"
    assert netguard.vet("http://[64:ff9b::5db8:d822]/").port == 80  # NAT64 of a public address
    assert netguard.vet("http://[2606:2800:220:1:248:1893:25c8:1946]/").port == 80
    for bad in ("ftp://93.184.216.34/", "http:///nohost", "http://93.184.216.34:99999/"):
        with pytest.raises(PermanentError):
            netguard.vet(bad, [])


def _failing_resolver(errno: int) -> Any:
    def getaddrinfo(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(errno, "resolver says no")

    return getaddrinfo


# Public DNS answers cannot exist on an offline machine: the resolver's failures are simulated.
@pytest.mark.parametrize("errno", [socket.EAI_AGAIN, socket.EAI_FAIL])
def test_name_server_failure_is_transient_for_both_tasks(monkeypatch: pytest.MonkeyPatch, errno: int) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _failing_resolver(errno))
    with pytest.raises(TransientError, match=r"cannot resolve hooks\.example\.com"):
        netguard.vet("https://hooks.example.com/h", ["hooks.example.com"])  # allowlisted or not
    with pytest.raises(TransientError):
        media_sources.resolve_public("https://cdn.example.com/a.mp4")


def test_a_name_that_does_not_exist_is_permanent_for_both_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _failing_resolver(socket.EAI_NONAME))
    with pytest.raises(PermanentError, match="no such name") as caught:
        netguard.vet("https://hooks.example.com/h", [])
    assert not isinstance(caught.value, TransientError)
    with pytest.raises(PermanentError, match="no such name"):
        media_sources.resolve_public("https://cdn.example.com/a.mp4")


def test_media_uses_the_guard_with_its_own_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(netguard.AddressRefused, match="MEDIA_ALLOW_PRIVATE_URLS"):
        media_sources.resolve_public("http://127.0.0.1:8080/a.mp4")
    monkeypatch.setenv("MEDIA_ALLOW_PRIVATE_URLS", "true")
    get_settings.cache_clear()
    try:
        assert media_sources.resolve_public("http://127.0.0.1:8080/a.mp4").address == "127.0.0.1"
        media_sources.check_url("http://10.1.2.3/a.mp4")
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


@pytest.mark.parametrize(
    ("host", "refused"),
    [
        ("localhost", True),
        ("Media.LOCALHOST", True),
        ("127.0.0.1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("169.254.169.254", True),
        ("10.1.2.3", True),
        ("93.184.216.34", False),
        ("cdn.example.com", False),  # a name: resolved later
    ],
)
def test_local_refusal_without_network(host: str, refused: bool) -> None:
    assert (netguard.local_refusal(host) is not None) is refused
    assert netguard.local_refusal(host, ["0.0.0.0/0", "::/0", "localhost", "media.localhost"]) is None
