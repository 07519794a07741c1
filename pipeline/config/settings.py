"""Settings: environment, `.env` and a secrets directory → one validated object → Celery's configuration.

Config flows one way: env → `Settings` → `celery_conf()` → `app.conf`. No other module reads
`os.environ`. Every field is documented in `.env.example`. An invalid value stops the process at start
with a message naming the variable (`ConfigError`), never a traceback from deep inside Celery.

Usage::

    settings = get_settings()          # cached; validated once per process
    app.conf.update(celery_conf(settings))
"""

from __future__ import annotations

import ipaddress
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.config.beat import BeatEntry
from pipeline.config.cluster import is_cluster
from pipeline.config.urls import check_redis_url
from pipeline.errors import ConfigError
from pipeline.retry import RetryPolicy
from pipeline.text import HeaderText

#: Where `pipeline run` starts its embedded Redis when REDIS_URL is not set; also the default REDIS_URL.
LOCAL_REDIS_PORT = 6390
API_TOKEN_MIN_LENGTH = 16
#: The webhook URL the shipped examples use; EXAMPLE_WEBHOOK_URL replaces it (`example`).
EXAMPLE_WEBHOOK_URL = "https://example.com/hooks"
#: Celery's rate syntax: tasks per second, minute or hour ("10/s", "100/m", "0.5/h").
RATE_PATTERN = r"^\d+(\.\d+)?/[smh]$"


class Settings(BaseSettings):
    """Every setting of the pipeline. Field names are the environment variables, upper-cased."""

    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True, env_ignore_empty=True
    )

    # --- Broker and result backend -------------------------------------------------------------
    #: Unset: the embedded development Redis that `pipeline run` starts on 127.0.0.1:LOCAL_REDIS_PORT.
    redis_url: str | None = Field(default=None, validation_alias=AliasChoices("REDIS_URL", "CELERY_BROKER_URL"))
    local_redis_port: int = Field(default=LOCAL_REDIS_PORT, ge=1, le=65535)
    #: Port of the SMTP sink `pipeline run` starts when SMTP_HOST is not set.
    local_smtp_port: int = Field(default=1025, ge=1, le=65535)
    #: Port of the webhook sink `pipeline run` starts when WEBHOOK_SIGNING_SECRET is not set.
    local_webhook_port: int = Field(default=1026, ge=1, le=65535)
    result_backend_url: str | None = Field(
        default=None, validation_alias=AliasChoices("RESULT_BACKEND_URL", "CELERY_RESULT_BACKEND")
    )
    redis_sentinel_master: str | None = None
    redis_sentinel_password: SecretStr | None = None
    redis_tls_cert_reqs: Literal["required", "optional", "none"] = "required"
    redis_tls_ca_file: Path | None = None
    #: Replicas that must hold a write before it counts (Redis's WAIT): an enqueue returns, a job is acknowledged
    #: and a result is stored only once this many replicas have it (docs/operations.md). 0: the primary alone.
    redis_wait_replicas: int = Field(default=0, ge=0, le=16)
    #: Longest wait for those replicas (milliseconds); past it the write is reported as not durable (an enqueue
    #: fails: the API answers 503 with Retry-After).
    redis_wait_timeout_ms: int = Field(default=1000, ge=10, le=60000)
    #: A worker's lease on each job it holds, renewed every third of it while the worker lives; a dead
    #: worker's jobs go back to their queues within a lease plus UNACKED_RESTORE_INTERVAL (docs/leases.md).
    lease_seconds: int = Field(default=30, ge=5, le=3600)
    #: How many jobs of one group (`enqueue(..., group=...)`) run at once across every worker; 0: no cap.
    group_concurrency: int = Field(default=0, ge=0, le=100000)
    #: Seconds between a worker's sweeps for deliveries whose lease expired.
    unacked_restore_interval: int = Field(default=10, ge=1, le=600)
    #: Read only to warn: leases (LEASE_SECONDS) replaced the visibility timeout of earlier releases.
    visibility_timeout: int | None = None

    # --- Tasks ------------------------------------------------------------------------------
    task_soft_time_limit: int = Field(default=270, ge=1)
    task_time_limit: int = Field(default=300, ge=2)
    result_expires: int = Field(default=86400, ge=60)
    retry_max_attempts: int = Field(default=5, ge=1, le=100)
    retry_base_delay: float = Field(default=2.0, ge=0)
    retry_max_delay: float = Field(default=600.0, ge=0, le=3600)
    retry_jitter: float = Field(default=0.2, ge=0, lt=1)
    enqueue_idempotency_ttl: int = Field(default=86400, ge=1)
    max_payload_bytes: int = Field(default=256 * 1024, ge=1024)
    #: Accepted jobs remembered per queue for the job browser's retrying / succeeded / failed lists.
    recent_jobs_max: int = Field(default=1000, ge=10, le=100_000)
    #: The priority of a job sent without one (0 most urgent .. 9; `pipeline.queues.priority`): one level below
    #: the top, so a job sent with priority 0-2 overtakes a backlog of default jobs.
    task_default_priority: int = Field(default=3, ge=0, le=9)

    # --- Scheduling: delayed jobs ----------------------------------------------------------------
    delayed_poll_interval: float = Field(default=1.0, gt=0, le=60)
    delayed_release_ahead: float = Field(default=2.0, ge=0)

    #: Stored outputs (STORAGE_BACKEND) older than this are removed by the nightly purge; seconds.
    artifact_max_age: int = Field(default=30 * 86400, ge=3600)

    # --- Scheduling: beat --------------------------------------------------------------------------
    #: The active beat's lease on the leader lock; a standby takes over this long after it dies.
    beat_lock_timeout: int = Field(default=30, ge=2, le=600)
    #: Longest sleep between beat ticks (each tick renews the lease).
    beat_max_loop_interval: float = Field(default=5.0, gt=0, le=300)
    #: The deployment's own beat entries (JSON object: name → {task, cron | every, payload, queue}).
    beat_schedule: dict[str, BeatEntry] = Field(default_factory=dict)

    # --- Rate limits ----------------------------------------------------------------------------
    #: Per-worker limits overriding the tasks' own `rate_limit` (JSON: task name → "100/m").
    task_rate_limits: dict[str, Annotated[str, StringConstraints(pattern=RATE_PATTERN)]] = Field(default_factory=dict)

    # --- Webhooks ---------------------------------------------------------------------------------
    #: HMAC-SHA256 key signing every delivery; required when ENVIRONMENT=production.
    webhook_signing_secret: SecretStr | None = None
    #: Hosts (exact names) and networks (CIDR) that may be delivered to although private/loopback/reserved.
    webhook_allowed_hosts: list[str] = Field(default_factory=list)
    #: Where the examples the page, the API and `pipeline flow start --example` offer send their webhooks (the
    #: webhook kind's, the `media` flow's): `https://example.com/hooks` is replaced by this. Unset: the webhook sink
    #: `pipeline run` starts (`http://127.0.0.1:LOCAL_WEBHOOK_PORT/hooks`), except in production.
    example_webhook_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    webhook_connect_timeout: float = Field(default=5.0, gt=0, le=60)
    #: Seconds to wait for each read/write of a delivery (the whole request is bounded by the task limits).
    webhook_timeout: float = Field(default=15.0, gt=0, le=300)
    #: One worker process's webhook client: open connections (kept alive), and requests at once to one host.
    webhook_max_connections: int = Field(default=500, ge=1, le=100_000)
    webhook_connections_per_host: int = Field(default=250, ge=1, le=100_000)
    #: Cluster-wide limit per destination host, N/s, N/m or N/h.
    webhook_rate_per_host: str = Field(default="10/s", pattern=RATE_PATTERN)

    # --- Worker -------------------------------------------------------------------------------
    #: `short` (email, webhooks, default: prefetch 4 per process), `long` (pdf, transcode: prefetch 1), or
    #: `auto` (the default): long when the worker consumes pdf or transcode, else short (docs/deployment.md).
    worker_profile: Literal["auto", "short", "long"] = "auto"
    #: Jobs each pool process reserves ahead. Unset: the profile's.
    worker_prefetch_multiplier: int | None = Field(default=None, ge=1)
    #: Task events from the start. Off: a worker sends them only once Flower (or `celery control
    #: enable_events`) asks, and stops again when nobody has asked for EVENTS_IDLE_TIMEOUT seconds.
    task_events: bool = False
    events_idle_timeout: float = Field(default=60.0, ge=10, le=86400)
    worker_soft_shutdown_timeout: float = Field(default=25.0, ge=0)
    #: Jobs in flight per process of the asyncio pool (`pipeline worker`: email, webhooks); `-c` overrides it.
    worker_concurrency: int = Field(default=150, ge=1, le=10_000)
    worker_plain_threads: int = Field(default=8, ge=1, le=1000)  #: plain jobs at once per asyncio-pool process
    worker_max_memory_per_child: int | None = Field(default=None, ge=1024)
    #: Deliveries of a message before it is dead-lettered (`delivery_limit`): one that kills its worker comes back.
    max_deliveries: int = Field(default=5, ge=1, le=1000)
    #: Read by Celery itself before any app code runs; recorded here so the worker can warn when it is missing.
    remap_sigterm: str | None = None
    #: A worker whose queues hold ready jobs it has room for, and that fetched none for this long, is stalled
    #: (its liveness probe fails); its heartbeat file also goes stale after it. Seconds.
    stall_timeout: float = Field(default=60.0, ge=1, le=3600)
    #: Where each worker node writes its heartbeat file (`pipeline worker-health` reads it).
    worker_health_dir: Path = Path("/tmp")  # noqa: S108  # the image's only writable directory

    # --- Dead-letter queue ----------------------------------------------------------------------
    dlq_max_age: int = Field(default=7 * 86400, ge=60)
    dlq_max_entries: int = Field(default=10_000, ge=1)

    # --- Email (tasks.email) ----------------------------------------------------------------------
    smtp_host: str = "localhost"
    #: Unset: 25 (none), 587 (starttls) or 465 (tls).
    smtp_port: int | None = Field(default=None, ge=1, le=65535)
    smtp_username: str | None = None
    smtp_password: SecretStr | None = None
    #: The From header of every message: one line (no line breaks or control characters).
    smtp_from: HeaderText = "pipeline@localhost"
    smtp_security: Literal["none", "starttls", "tls"] = "starttls"
    smtp_timeout: float = Field(default=30.0, gt=0, le=600)
    smtp_pool_size: int = Field(default=10, ge=1, le=1000)  #: open SMTP sessions per worker process, at most
    #: CA bundle to verify the SMTP server's certificate (unset: the system's trust store).
    smtp_tls_ca_file: Path | None = None
    email_idempotency_ttl: int = Field(default=7 * 86400, ge=60)
    #: Total bytes of the stored objects one email attaches (read on the worker; over it, the job dead-letters).
    email_attachments_max_bytes: int = Field(default=10 * 1024 * 1024, ge=1, le=100 * 1024 * 1024)

    # --- Media (tasks.media) ---------------------------------------------------------------------
    #: Local transcode sources must resolve inside this directory. Unset: `<DATA_DIR>/media`.
    media_root: Path | None = None
    #: Unset: `ffmpeg` on PATH, else the binary the imageio-ffmpeg wheel ships.
    ffmpeg_binary: str | None = None
    #: Allow http(s) sources on private, loopback and link-local addresses (in-cluster media servers).
    media_allow_private_urls: bool = False
    transcode_soft_time_limit: int = Field(default=10200, ge=1)
    transcode_time_limit: int = Field(default=10800, ge=2)

    # --- Storage of task outputs (PDFs, transcodes) --------------------------------------------
    storage_backend: Literal["local", "s3"] = "local"
    #: Unset: `<DATA_DIR>/storage`.
    storage_dir: Path | None = None
    s3_bucket: str | None = None
    s3_prefix: str = ""
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None

    # --- Producer API ---------------------------------------------------------------------------
    #: Bearer token every API call must carry. Unset: the API refuses to start (`pipeline run` makes one).
    api_token: SecretStr | None = None
    api_max_body_bytes: int = Field(default=512 * 1024, ge=1024)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    #: Seconds a client is told to wait (Retry-After) when the broker is unreachable.
    api_retry_after: int = Field(default=5, ge=1, le=3600)
    #: Seconds a request's whole body may take to arrive; past it the answer is 408 and the connection closes.
    api_body_timeout: float = Field(default=10.0, gt=0, le=600)

    # --- Library versions -----------------------------------------------------------------------
    #: Start beat, the worker, the API and the CLI even when Celery, kombu, billiard, celery-redbeat or redis-py is
    #: a version the pipeline's replacements of their internals were not verified on (`pipeline.compat.versions`);
    #: a WARNING names it. Off: such a process refuses to start, naming the library and both versions. The
    #: replacements made only for speed stay off on such versions either way (Celery's and kombu's own code runs).
    allow_unverified_versions: bool = False

    # --- Local stack and logs -----------------------------------------------------------------
    data_dir: Path = Path(".data")
    environment: str = "development"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # --- Observability --------------------------------------------------------------------------
    #: Port of the worker node's /metrics endpoint (one per node, served by the main process). Unset: none.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_address: str = "0.0.0.0"  # noqa: S104  # scraped from other hosts; restrict by network policy
    #: prometheus-client's multiprocess directory, set and wiped by the start scripts. Unset: a worker with
    #: METRICS_PORT makes its own (`pipeline.observability.multiproc`); Python never wipes a given one.
    prometheus_multiproc_dir: Path | None = None
    metrics_sweep_interval: float = Field(default=30.0, gt=0)
    #: Port of `pipeline exporter` (queue depth, in-flight, oldest age, DLQ size).
    exporter_port: int = Field(default=9809, ge=1, le=65535)
    log_format: Literal["auto", "json", "text"] = "auto"
    #: Write task arguments, return values and message bodies into logs (and so Sentry events). Off: never.
    log_payloads: bool = False
    #: Flower's basic auth, `user:password[,user2:password2]`. Required unless FLOWER_UNAUTHENTICATED.
    flower_basic_auth: SecretStr | None = None
    #: Development only: let Flower start without authentication (`pipeline run` sets it).
    flower_unauthenticated: bool = False
    #: Empty: Sentry is off.
    sentry_dsn: SecretStr | None = None
    sentry_traces_sample_rate: float = Field(default=0.0, ge=0, le=1)
    #: Release name for error reports (e.g. the image tag or git sha). Empty: the package version.
    release: str | None = Field(default=None, validation_alias=AliasChoices("RELEASE", "SENTRY_RELEASE"))

    @field_validator("webhook_signing_secret", "example_webhook_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        check_redis_url("REDIS_URL", self.broker_url, self.redis_sentinel_master)
        if self.result_backend_url:
            check_redis_url("RESULT_BACKEND_URL", self.result_backend_url, self.redis_sentinel_master)
            if is_cluster(self.result_backend_url) and self.result_backend_url != self.broker_url:
                raise ValueError(
                    "RESULT_BACKEND_URL: a Redis Cluster holds results only as REDIS_URL's own cluster (the same URL,"
                    " or leave it empty): each result is fenced by a stamp the worker writes there"
                )
        if self.task_soft_time_limit >= self.task_time_limit:
            raise ValueError("TASK_SOFT_TIME_LIMIT must be below TASK_TIME_LIMIT, so tasks can clean up")
        if self.transcode_soft_time_limit >= self.transcode_time_limit:
            raise ValueError("TRANSCODE_SOFT_TIME_LIMIT must be below TRANSCODE_TIME_LIMIT, so ffmpeg can be stopped")
        self._check_scheduling()
        if self.retry_max_delay < self.retry_base_delay:
            raise ValueError("RETRY_MAX_DELAY must be at least RETRY_BASE_DELAY")
        if self.smtp_username and self.smtp_password is None:
            raise ValueError("SMTP_USERNAME is set: set SMTP_PASSWORD too")
        if self.smtp_tls_ca_file is not None and not self.smtp_tls_ca_file.is_file():
            raise ValueError(f"SMTP_TLS_CA_FILE: no such file {self.smtp_tls_ca_file}")
        if self.storage_backend == "s3" and not self.s3_bucket:
            raise ValueError("STORAGE_BACKEND=s3 needs S3_BUCKET")
        if self.prometheus_multiproc_dir is not None and not self.prometheus_multiproc_dir.is_dir():
            raise ValueError(
                f"PROMETHEUS_MULTIPROC_DIR: {self.prometheus_multiproc_dir} is not a directory "
                "(the start scripts create it; unset it and a worker with METRICS_PORT makes one of its own)"
            )
        if self.api_token is not None and len(self.api_token.get_secret_value()) < API_TOKEN_MIN_LENGTH:
            raise ValueError(f"API_TOKEN must be at least {API_TOKEN_MIN_LENGTH} characters (use a random secret)")
        if self.redis_tls_ca_file is not None and not self.redis_tls_ca_file.is_file():
            raise ValueError(f"REDIS_TLS_CA_FILE: no such file {self.redis_tls_ca_file}")
        return self

    def _check_scheduling(self) -> None:
        if self.beat_lock_timeout < 2 * self.beat_max_loop_interval:
            raise ValueError("BEAT_LOCK_TIMEOUT must be at least twice BEAT_MAX_LOOP_INTERVAL, or the lease lapses")
        if self.environment == "production" and self.webhook_signing_secret is None:
            raise ValueError("WEBHOOK_SIGNING_SECRET is required in production")
        for entry in self.webhook_allowed_hosts:
            check_allowed_host(entry)

    @property
    def release_ahead(self) -> float:
        """DELAYED_RELEASE_AHEAD: how early a parked job is released to its queue (a worker holds it meanwhile,
        its lease renewed like a running job's)."""
        return self.delayed_release_ahead

    @property
    def worker_hold_limit(self) -> float:
        """The longest wait a worker holds a message for (a retry's countdown) before running it. A live worker
        renews the lease of every message it holds, so no timeout bounds this any more; what a held wait costs
        is memory and a message that sits in one worker: waits up to RETRY_MAX_DELAY (every backoff the retry
        policy computes) are held, longer ones (a Retry-After) are parked in Redis."""
        return max(self.retry_max_delay, self.release_ahead)

    @property
    def broker_url(self) -> str:
        return self.redis_url or f"redis://127.0.0.1:{self.local_redis_port}/0"

    @property
    def result_url(self) -> str:
        return self.result_backend_url or self.broker_url

    @property
    def smtp_port_or_default(self) -> int:
        return self.smtp_port or {"none": 25, "starttls": 587, "tls": 465}[self.smtp_security]

    @property
    def media_path(self) -> Path:
        """Root that local transcode sources must resolve inside."""
        return self.media_root or self.data_dir / "media"

    @property
    def storage_path(self) -> Path:
        """Root of the local storage backend."""
        return self.storage_dir or self.data_dir / "storage"

    def retry_policy(self) -> RetryPolicy:
        """The default retry policy; tasks override fields of it with `dataclasses.replace`."""
        return RetryPolicy(
            max_attempts=self.retry_max_attempts,
            base_delay=self.retry_base_delay,
            max_delay=self.retry_max_delay,
            jitter=self.retry_jitter,
        )


def example(value: Any) -> Any:
    """`value` (an example payload or input) with its webhook URLs pointed at EXAMPLE_WEBHOOK_URL."""
    if isinstance(value, str) and value.startswith(EXAMPLE_WEBHOOK_URL):
        settings = get_settings()
        base = settings.example_webhook_url or (
            EXAMPLE_WEBHOOK_URL
            if settings.environment == "production"
            else f"http://127.0.0.1:{settings.local_webhook_port}/hooks"
        )
        return base.rstrip("/") + value[len(EXAMPLE_WEBHOOK_URL) :]
    if isinstance(value, dict):
        return {k: example(v) for k, v in value.items()}
    if isinstance(value, list):
        return [example(v) for v in value]
    return value


def check_allowed_host(entry: str) -> None:
    """A WEBHOOK_ALLOWED_HOSTS entry: a host name, an IP address or a CIDR network."""
    if "/" in entry or entry.replace(".", "").isdigit() or ":" in entry:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(f"WEBHOOK_ALLOWED_HOSTS: {entry!r} is not an address or CIDR network") from None
    elif not entry or any(c in entry for c in " @?#"):
        raise ValueError(f"WEBHOOK_ALLOWED_HOSTS: {entry!r} is not a host name")


def _secrets_dir() -> str | None:
    path = os.environ.get("SECRETS_DIR", "/run/secrets")
    return path if Path(path).is_dir() else None


def load_settings(**overrides: Any) -> Settings:
    """Read and validate settings; on error raise `ConfigError` naming each bad variable."""
    try:
        env_file = os.environ.get("ENV_FILE", ".env") or None
        return Settings(_secrets_dir=_secrets_dir(), _env_file=env_file, **overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]).upper()
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc + ': ' if loc else ''}{msg}")
        raise ConfigError("pipeline: invalid configuration\n" + "\n".join(lines)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, validated once."""
    return load_settings()
