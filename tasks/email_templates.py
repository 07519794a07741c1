"""Email templates: one folder per template under `tasks/templates/email/<id>/`, rendered with Jinja2.

A folder holds `body.txt` and `body.html` (both required) and optionally `subject.txt`. HTML is
autoescaped (a variable holding `<script>` arrives as text); every template is strict: a variable it
uses but the job did not pass is an error (`TemplateError`), never an empty string.

Links: a variable named `url` or ending in `_url` must be an absolute `http://` or `https://` URL
(`check_variables`, run when the payload is validated), and templates put links through the
`http_url` filter (`<a href="{{ action_url | http_url }}">`), which refuses anything else at render
time: a `javascript:` or `data:` URL never becomes an `href`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import jinja2

EMAIL_TEMPLATES = Path(__file__).parent / "templates" / "email"
TEMPLATE_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
#: Variables holding a link: `url`, `action_url`, `reset_url`...
URL_VARIABLE = re.compile(r"^(?:.*_)?url$", re.IGNORECASE)
URL_SCHEMES = ("http", "https")
MAX_URL_LENGTH = 2048


class TemplateError(ValueError):
    """Unknown template, or a variable missing for it."""


@dataclass(frozen=True)
class Rendered:
    subject: str | None
    text: str
    html: str


def http_url(value: object) -> str:
    """`value` if it is an absolute http(s) URL with a host and no whitespace or control character."""
    text = str(value)
    if len(text) > MAX_URL_LENGTH:
        raise TemplateError(f"a link is longer than {MAX_URL_LENGTH} characters")
    if any(char.isspace() or not char.isprintable() for char in text):
        raise TemplateError("a link must not contain whitespace or control characters")
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError as exc:
        raise TemplateError(f"a link is not a valid URL: {exc}") from None
    if parts.scheme.lower() not in URL_SCHEMES or not host:
        scheme = f"{parts.scheme}:" if parts.scheme else "no scheme"
        raise TemplateError(f"a link must be an absolute http:// or https:// URL (got {scheme})")
    return text


def check_variables(variables: dict[str, str]) -> dict[str, str]:
    """`variables` unchanged if every URL-named one (`url`, `*_url`) holds an http(s) URL; else TemplateError."""
    for name, value in variables.items():
        if URL_VARIABLE.match(name):
            try:
                http_url(value)
            except TemplateError as exc:
                raise TemplateError(f"variable {name!r}: {exc}") from None
    return variables


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(EMAIL_TEMPLATES),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html",), default_for_string=True),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["http_url"] = http_url
    return env


def available() -> list[str]:
    return sorted(p.name for p in EMAIL_TEMPLATES.iterdir() if (p / "body.txt").is_file())


def render(template_id: str, variables: dict[str, str]) -> Rendered:
    """The subject (if the template has one), text and HTML parts of `template_id` with `variables`."""
    if not TEMPLATE_ID.match(template_id) or not (EMAIL_TEMPLATES / template_id / "body.txt").is_file():
        raise TemplateError(f"unknown email template {template_id!r}; available: {', '.join(available())}")
    env = environment()
    try:
        subject = None
        if (EMAIL_TEMPLATES / template_id / "subject.txt").is_file():
            subject = " ".join(env.get_template(f"{template_id}/subject.txt").render(variables).split())
        text = env.get_template(f"{template_id}/body.txt").render(variables)
        html = env.get_template(f"{template_id}/body.html").render(variables)
    except jinja2.UndefinedError as exc:
        raise TemplateError(f"template {template_id!r}: {exc.message}") from None
    except jinja2.TemplateNotFound as exc:
        raise TemplateError(f"template {template_id!r} is missing {exc.name}") from None
    return Rendered(subject, text, html)
