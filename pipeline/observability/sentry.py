"""Sentry: initialisation per component and the scrubber every event passes through.

`init_sentry(component)` does nothing when SENTRY_DSN is empty. Workers call it from `celeryd_init`
(main process, before the pool forks: the SDK re-creates its sender thread in each child), beat
from `beat_init` (so Sentry Crons monitors the beat entries), the API from its start-up.

Nothing secret leaves the process: `send_default_pii=False` (task args/kwargs are sent as
"[Filtered]"), `include_local_variables=False` (frame locals hold payloads and passwords), and
`scrub_event` rewrites every string of the event: the value of every secret setting (any
`SecretStr` field of `Settings`: SMTP password, tokens, signing keys, ...), passwords inside URLs,
`password=...`-style pairs, e-mail addresses, and every value of a request's query string.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

import sentry_sdk
from pydantic import SecretStr
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.scrubber import DEFAULT_DENYLIST, EventScrubber

from pipeline.broker import redact_url
from pipeline.config import Settings, get_settings
from pipeline.observability import payloads

FILTERED = "[Filtered]"
_PAIRS = re.compile(
    r"(?i)\b(?P<key>password|passwd|pwd|secret|token|api[_-]?key|authorization|auth)"
    r"(?P<sep>[\"']?\s*[:=]\s*[\"']?)(?:Bearer\s+|Basic\s+)?[^\s\"'&,;]+"
)
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
_DENYLIST = [*DEFAULT_DENYLIST, "smtp_password", "signing_key", "dsn", "broker_url", "redis_url"]


MIN_SECRET = 4  # shorter values are not removed from text: they would match ordinary words
#: Secret settings that are `user:password[,user2:password2]` lists: the passwords are secret, the users not.
USER_PASSWORD_LISTS = frozenset({"flower_basic_auth"})
#: Secret settings that are URLs whose user part is a credential too (a DSN's key).
URL_KEYS = frozenset({"sentry_dsn"})


def _secret_parts(name: str, raw: str) -> list[str]:
    """What of one secret setting's value is secret: the whole value, plus its credential parts."""
    parts = [raw]
    if name in USER_PASSWORD_LISTS:
        parts += [item.partition(":")[2] for item in raw.split(",")]
    elif "://" in raw:
        try:
            url = urlsplit(raw)
            parts += [url.password or "", (url.username or "") if name in URL_KEYS else ""]
        except ValueError:  # not a URL after all: the whole value stands
            pass
    return parts


def secret_values(settings: Settings) -> list[str]:
    """The secret values to remove from text, longest first (so overlapping secrets are all removed).

    Exact values only: each secret setting's whole value (any `SecretStr` field of `Settings`), the
    passwords of `user:password` lists and of URLs, and a DSN's key; never user names, schemes or
    other fragments, which would turn ordinary words ("admin", "http") into `[Filtered]`.
    """
    values: set[str] = set()
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            values.update(p for p in _secret_parts(name, value.get_secret_value()) if len(p) >= MIN_SECRET)
    return sorted(values, key=len, reverse=True)


def scrub_text(text: str, secrets: list[str], *, emails: bool = True) -> str:
    """`text` without the `secrets`, URL passwords, `password=...` values and (with `emails`) addresses."""
    for secret in secrets:
        text = text.replace(secret, FILTERED)
    text = redact_url(text, FILTERED)
    text = _PAIRS.sub(lambda m: f"{m.group('key')}{m.group('sep')}{FILTERED}", text)
    return _EMAIL.sub("[email]", text) if emails else text


def redact_query(query: str) -> str:
    """A URL query string with every value replaced by `[Filtered]`, names kept: `token=[Filtered]&page=[Filtered]`."""
    if not query:
        return query
    items = (item.partition("=") for item in query.split("&"))
    return "&".join(f"{name}={FILTERED}" if sep else FILTERED for name, sep, _ in items)


def _walk(value: Any, fix: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fix(value)
    if isinstance(value, dict):
        return {k: _walk(v, fix) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk(v, fix) for v in value]
    return value


def scrub_event(event: dict[str, Any], _hint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Remove secrets, e-mail addresses and task payloads from an event before it is sent."""
    job = event.get("extra", {}).get("celery-job")
    if isinstance(job, dict):
        job["args"] = job["kwargs"] = FILTERED
        if job.get("task_name"):
            event.setdefault("tags", {})["celery_task_name"] = job["task_name"]
    request = event.get("request")
    if isinstance(request, dict) and isinstance(request.get("query_string"), str):
        request["query_string"] = redact_query(request["query_string"])
    secrets = secret_values(get_settings())
    scrubbed: dict[str, Any] = _walk(event, lambda s: scrub_text(s, secrets))
    return scrubbed


def _release(settings: Settings) -> str:
    if settings.release:
        return settings.release
    try:
        return f"pipeline@{version('pipeline')}"
    except PackageNotFoundError:
        return "pipeline@unknown"


def init_sentry(component: str) -> bool:
    """Start error reporting for `component` (worker, beat, api, ...); False when SENTRY_DSN is empty."""
    settings = get_settings()
    if settings.sentry_dsn is None or not settings.sentry_dsn.get_secret_value():
        return False
    sentry_sdk.init(
        dsn=settings.sentry_dsn.get_secret_value(),
        environment=settings.environment,
        release=_release(settings),
        send_default_pii=False,
        include_local_variables=False,
        max_request_body_size="never",
        event_scrubber=EventScrubber(denylist=_DENYLIST, recursive=True),
        before_send=scrub_event,  # type: ignore[arg-type]  # the SDK's Event is a TypedDict of these keys
        before_send_transaction=scrub_event,  # type: ignore[arg-type]  # same
        traces_sample_rate=settings.sentry_traces_sample_rate,
        integrations=[CeleryIntegration(monitor_beat_tasks=component == "beat", propagate_traces=True)],
    )
    payloads.install(settings.log_payloads)  # error log lines become events: none may carry a payload
    sentry_sdk.set_tag("component", component)
    return True
