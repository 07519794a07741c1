"""A test-only task that leaks on purpose: it logs, and fails with secrets and an e-mail address in its error.

Used by the observability tests to prove that logs and error reports carry the task's identity and
none of its secrets.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, SecretStr

from pipeline.config import get_settings
from pipeline.errors import PermanentError
from pipeline.task import JobContext, typed_task

log = logging.getLogger("tests.obs")


def _plain(secret: SecretStr | None) -> str:
    """A secret setting's text ('' when unset)."""
    return secret.get_secret_value() if secret else ""


def _secrets() -> tuple[str, str, str]:
    """Flower's basic auth, the Sentinel password and the Sentry DSN as text: what the tasks leak on purpose."""
    settings = get_settings()
    return _plain(settings.flower_basic_auth), _plain(settings.redis_sentinel_password), _plain(settings.sentry_dsn)


class LeakyJob(BaseModel):
    email: str
    smtp_password: str
    note: str
    fail: bool = True


class LeakyResult(BaseModel):
    ok: bool


@typed_task("test.leaky", kind="test-leaky", payload=LeakyJob, result=LeakyResult)
def leaky(job: LeakyJob, ctx: JobContext) -> LeakyResult:
    flower, sentinel, _ = _secrets()
    log.info("rendering the report", extra={"report_kind": "weekly"})
    log.warning("retrying smtp://mailer:%s@smtp.example.com with sentinel password %s", job.smtp_password, sentinel)
    if not job.fail:
        return LeakyResult(ok=True)
    raise PermanentError(
        f"SMTP login refused for {job.email} via smtp://mailer:{job.smtp_password}@smtp.example.com; "
        f"flower auth {flower}; sentinel {sentinel}; password={job.smtp_password}"
    )


class TalkJob(BaseModel):
    echo: str


class TalkResult(BaseModel):
    echo: str


@typed_task("test.talker", kind="test-talker", payload=TalkJob, result=TalkResult)
def talker(job: TalkJob, ctx: JobContext) -> TalkResult:
    """Logs an error naming a user, a URL, Flower's password and the Sentry DSN; returns its payload."""
    flower, _, dsn = _secrets()
    log.error(
        "user admin fetched https://example.org/report; flower password %s; dsn %s", flower.partition(":")[2], dsn
    )
    return TalkResult(echo=job.echo)
