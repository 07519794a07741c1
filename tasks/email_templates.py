"""Email templates: one folder per template under `tasks/templates/email/<id>/`, rendered with Jinja2.

A folder holds `body.txt` and `body.html` (both required) and optionally `subject.txt`. HTML is
autoescaped (a variable holding `<script>` arrives as text); every template is strict: a variable it
uses but the job did not pass is an error (`TemplateError`), never an empty string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

EMAIL_TEMPLATES = Path(__file__).parent / "templates" / "email"
TEMPLATE_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


class TemplateError(ValueError):
    """Unknown template, or a variable missing for it."""


@dataclass(frozen=True)
class Rendered:
    subject: str | None
    text: str
    html: str


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(EMAIL_TEMPLATES),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html",), default_for_string=True),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


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
