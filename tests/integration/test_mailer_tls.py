"""tasks.mailer against real aiosmtpd servers speaking STARTTLS and implicit TLS, with AUTH."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

from pipeline.config import load_settings
from pipeline.pools import aio
from tasks import mailer
from tests.support.procs import free_port
from tests.support.smtp import Recorder

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
    ok = isinstance(auth_data, LoginPassword) and (auth_data.login, auth_data.password) == (b"mailer", b"s3cret")
    return AuthResult(success=ok, handled=False)


@pytest.fixture(params=["starttls", "tls"])
def tls_server(request: pytest.FixtureRequest, certificate: tuple[Path, Path]) -> Iterator[tuple[str, int, Recorder]]:
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    recorder, port = Recorder(), free_port()
    options: dict[str, Any] = {"authenticator": authenticate, "auth_require_tls": True}
    if request.param == "starttls":
        options.update(tls_context=context, require_starttls=True)
    else:  # implicit TLS: aiosmtpd only counts STARTTLS as TLS for its auth_require_tls check
        options.update(ssl_context=context, auth_require_tls=False)
    controller = Controller(recorder, hostname="127.0.0.1", port=port, **options)
    controller.start()
    yield request.param, port, recorder
    aio.resolve(aio.close_loop_resources())  # this thread's loop: the sessions the test opened, QUIT
    controller.stop()


def message() -> EmailMessage:
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "tests@pipeline.test", "ada@example.com", "over TLS"
    msg.set_content("hello")
    return msg


def test_tls_and_login(tls_server: tuple[str, int, Recorder], certificate: tuple[Path, Path]) -> None:
    security, port, recorder = tls_server
    settings = load_settings(
        smtp_host="127.0.0.1", smtp_port=port, smtp_security=security, smtp_username="mailer",
        smtp_password="s3cret", smtp_tls_ca_file=certificate[0],  # noqa: S106 - the test server's password
    )  # fmt: skip
    assert aio.resolve(mailer.send(settings, message(), ["ada@example.com"])) == ["ada@example.com"]
    (received,) = recorder.received
    assert received.tls
    assert received.message["Subject"] == "over TLS"


def test_wrong_password_is_permanent(tls_server: tuple[str, int, Recorder], certificate: tuple[Path, Path]) -> None:
    security, port, recorder = tls_server
    settings = load_settings(
        smtp_host="127.0.0.1", smtp_port=port, smtp_security=security, smtp_username="mailer",
        smtp_password="wrong", smtp_tls_ca_file=certificate[0],  # noqa: S106 - a wrong password on purpose
    )  # fmt: skip
    with pytest.raises(mailer.SmtpPermanent, match="535"):
        aio.resolve(mailer.send(settings, message(), ["ada@example.com"]))
    assert recorder.received == []


def test_untrusted_certificate_is_refused(tls_server: tuple[str, int, Recorder]) -> None:
    security, port, recorder = tls_server
    settings = load_settings(smtp_host="127.0.0.1", smtp_port=port, smtp_security=security)
    with pytest.raises(mailer.SmtpTransient, match="CERTIFICATE_VERIFY_FAILED"):
        aio.resolve(mailer.send(settings, message(), ["ada@example.com"]))
    assert recorder.received == []
