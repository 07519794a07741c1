"""email.send payloads: templates render strictly and autoescaped; bad payloads are refused before publishing."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import load_settings
from pipeline.errors import ConfigError, PayloadInvalid
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
        (job(variables={**WELCOME, "action_url": "javascript:alert(1)"}), "'action_url': a link must be"),
        (job(variables={**WELCOME, "action_url": "data:text/html,<b>x</b>"}), "'action_url'"),
        (job(variables={**WELCOME, "action_url": "//evil.example/x"}), "'action_url'"),
        (job(variables={**WELCOME, "action_url": " https://example.com"}), "'action_url'"),
        (
            job(
                template_id="password-reset", variables={"name": "A", "reset_url": "ftp://x/y", "expires_minutes": "5"}
            ),
            "'reset_url'",
        ),
        (job(variables={**WELCOME, "name": "Ada\x07"}), "subject rendered from the variables"),
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


#: Every line or paragraph separator Python knows (str.splitlines), and other control characters.
SEPARATORS = ["\r", "\n", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x00", "\t", "\x1b", "\x7f"]


@pytest.mark.parametrize("char", SEPARATORS, ids=[f"U+{ord(c):04X}" for c in SEPARATORS])
@pytest.mark.parametrize("field", ["subject", "to", "cc", "bcc", "reply_to"])
def test_header_fields_refuse_separators_and_controls_at_enqueue(field: str, char: str) -> None:
    value = f"Hi{char}Bcc: victim@example.com" if field == "subject" else f"Ada{char}Eve <ada@example.com>"
    payload = job(**{field: value if field in ("subject", "reply_to") else [value]})
    with pytest.raises(PayloadInvalid, match=f"found U\\+{ord(char):04X}"):
        send.enqueue(payload)


def test_header_fields_keep_ordinary_unicode_and_names() -> None:
    parsed = EmailJob.model_validate(job(subject="Grüße \u2013 ✓ 日本", to=["Ada Lovelace <ada@example.com>"]))
    assert build_message(parsed, "k")["Subject"] == "Grüße \u2013 ✓ 日本"
    assert parsed.to == ["ada@example.com"]


def test_links_render_only_as_http_urls() -> None:
    assert email_templates.check_variables({"url": "http://example.com/a", "name": "javascript:x"})
    with pytest.raises(email_templates.TemplateError, match="'Docs_URL'"):
        email_templates.check_variables({"Docs_URL": "javascript:x"})
    assert email_templates.check_variables({"curl": "javascript:x", "urls": "x"})  # not link variables
    env = email_templates.environment()
    link = env.from_string('<a href="{{ u | http_url }}">x</a>')
    assert link.render(u="HTTPS://example.com/a?b=1&c=2") == '<a href="HTTPS://example.com/a?b=1&amp;c=2">x</a>'
    for bad in ("javascript:alert(1)", "JaVaScRiPt:alert(1)", "java\tscript:x", "https:no-host", "mailto:a@b.c"):
        with pytest.raises(email_templates.TemplateError, match="link"):
            link.render(u=bad)


def test_smtp_from_is_one_header_line() -> None:
    assert load_settings(smtp_from="Pipeline Tests <tests@pipeline.test>").smtp_from.startswith("Pipeline")
    with pytest.raises(ConfigError, match=r"SMTP_FROM.*U\+2028"):
        load_settings(smtp_from="Pipeline\u2028Bcc: victim@example.com <tests@pipeline.test>")
