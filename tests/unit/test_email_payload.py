"""email.send payloads: templates render strictly and autoescaped; bad payloads are refused before publishing."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.errors import PayloadInvalid
from tasks import email_templates
from tasks.email import EmailJob, build_message, send

WELCOME = {"name": "Ada", "product": "Pipeline", "action_url": "https://example.com/start?a=1&b=2"}


def job(**overrides: Any) -> dict[str, Any]:
    return {"to": ["ada@example.com"], "template_id": "welcome", "variables": WELCOME, **overrides}


def test_shipped_templates() -> None:
    assert {"welcome", "password-reset"} <= set(email_templates.available())
    reset = email_templates.render(
        "password-reset", {"name": "Ada", "reset_url": "https://x/r/1", "expires_minutes": "30"}
    )
    assert reset.subject == "Reset your password"
    assert "https://x/r/1" in reset.text
    assert "30 minutes" in reset.html


def test_html_is_autoescaped_text_is_not() -> None:
    rendered = email_templates.render("welcome", {**WELCOME, "name": "<script>x</script>"})
    assert "&lt;script&gt;x&lt;/script&gt;" in rendered.html
    assert "<script>" not in rendered.html
    assert "Hello <script>x</script>," in rendered.text
    assert 'href="https://example.com/start?a=1&amp;b=2"' in rendered.html


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (job(template_id="nope"), "unknown email template 'nope'"),
        (job(template_id="../secret"), "template_id"),
        (job(variables={"name": "Ada"}), "'product' is undefined"),
        (job(to=[]), "to"),
        (job(to=["not-an-address"]), "to.0"),
        (job(to=[f"u{i}@example.com" for i in range(51)]), "to"),
        (job(subject="Hi\r\nBcc: victim@example.com"), "subject"),
        (job(surprise=1), "surprise"),
    ],
)
def test_bad_payload_refused_at_enqueue(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadInvalid, match=r"email\.send") as info:
        send.enqueue(payload)  # raises before anything is published: no broker is needed for this test
    assert message in str(info.value)


def test_message_has_both_parts_and_a_stable_message_id() -> None:
    parsed = EmailJob.model_validate(job(cc=["bob@example.com"], bcc=["eve@example.com"], reply_to="help@example.com"))
    first, second = build_message(parsed, "key-1"), build_message(parsed, "key-1")
    assert first["Message-ID"] == second["Message-ID"] != build_message(parsed, "key-2")["Message-ID"]
    assert first["Subject"] == "Welcome to Pipeline, Ada"
    assert first["Cc"] == "bob@example.com"
    assert first["Bcc"] is None
    assert first["Reply-To"] == "help@example.com"
    assert [p.get_content_type() for p in first.iter_parts()] == ["text/plain", "text/html"]
    assert parsed.recipients == ["ada@example.com", "bob@example.com", "eve@example.com"]
