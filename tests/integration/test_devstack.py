"""`pipeline run` (what `make run` calls): the stack starts, runs a job, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.cli import run_pipeline
from tests.support.full import fill, full_node, pipeline_command, states
from tests.support.procs import Command, free_port, wait_for
from tests.support.replicas import ProducerProcess

pytestmark = pytest.mark.integration


def test_local_stack_runs_a_job_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "LOCAL_REDIS_PORT": str(port),
        "LOCAL_SMTP_PORT": str(free_port()),
        "LOCAL_WEBHOOK_PORT": str(free_port()),
        "DATA_DIR": str(tmp_path / "data"),
    }
    unset = ("REDIS_URL", "SMTP_HOST", "SMTP_PORT", "SMTP_SECURITY", "WEBHOOK_SIGNING_SECRET", "WEBHOOK_ALLOWED_HOSTS")
    for name in (*unset, "EXAMPLE_WEBHOOK_URL", "MEDIA_ROOT"):  # nothing configured: embedded defaults
        env.pop(name, None)
    log = (tmp_path / "stack.log").open("w+")
    stack = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", "--no-api"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: " ready." in Path(log.name).read_text(), 90, 0.2, what="the stack's worker")
        children = psutil.Process(stack.pid).children(recursive=True)
        assert len(children) >= 4  # redis, worker (+ pool), beat, flower
        # The embedded Redis is 7 or later (pipeline/cli/redis_bin.py), and the banner says which it is.
        embedded = re.search(r"\(embedded (Redis|Valkey) (\d+)\.\d+\.\d+ \((\S+)\)", Path(log.name).read_text())
        assert embedded and int(embedded[2]) >= 7, Path(log.name).read_text()[:2000]
        assert os.path.realpath(embedded[3]) in [child.exe() for child in children]  # the one started
        local = {**env, "REDIS_URL": f"redis://127.0.0.1:{port}/0"}
        probe = ("enqueue", "probe", "--set", "message=local", "--wait", "--json", "--timeout", "60")
        proc = run_pipeline(*probe, env=local)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["result"]["message"] == "local"
        assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # AOF persistence on

        # With no SMTP_HOST, email jobs go to the stack's development sink, which prints them.
        mail = run_pipeline(
            *("enqueue", "email", "--wait", "--json", "--timeout", "60"),
            '{"to": ["dev@example.com"], "template_id": "welcome", "variables": '
            '{"name": "Dev", "product": "Pipeline", "action_url": "https://example.com/start"}}',
            env=local,
        )
        assert mail.returncode == 0, mail.stderr
        wait_for(lambda: "dev@example.com" in Path(log.name).read_text(), 10, 0.2, what="the printed message")
        assert "https://example.com/start" in Path(log.name).read_text()

        # With no WEBHOOK_SIGNING_SECRET, webhooks are signed with a development secret and the stack's sink
        # prints them; the examples point at it.
        hook = f"http://127.0.0.1:{env['LOCAL_WEBHOOK_PORT']}/hooks/orders"
        webhook = json.dumps({"url": hook, "event": "order.paid", "payload": {"order": 1}})
        sent = run_pipeline("enqueue", "webhook", "--wait", "--json", "--timeout", "60", webhook, env=local)
        assert sent.returncode == 0, sent.stderr
        printed = "webhook /hooks/orders event=order.paid signature=valid"
        wait_for(lambda: printed in Path(log.name).read_text(), 10, 0.2, what="the printed webhook")
        assert (tmp_path / "data" / "media" / "sample.mp4").is_file()  # the transcode and media examples' source

        # Both shipped flows run from their example input: the invoice is mailed to the sink with its PDF, the
        # media flow's three renditions are announced by one webhook to the sink.
        for flow in ("invoice", "media"):
            start = ("flow", "start", flow, "--example", "--wait", "--json", "--timeout", "120")
            started = run_pipeline(*start, env=local, timeout=150)
            assert started.returncode == 0, started.stdout + started.stderr
            assert json.loads(started.stdout)["state"] == "succeeded"
        wait_for(lambda: "event=media.transcoded signature=valid" in Path(log.name).read_text(), 10, 0.2)
        assert "invoice-INV-1001.pdf" in Path(log.name).read_text()  # the attachment, as the mail sink prints it

        stack.send_signal(signal.SIGINT)
        assert stack.wait(60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:  # on failure, leave nothing behind: the launcher and every process it started, by PID
        for proc_ in [psutil.Process(stack.pid), *children] if stack.poll() is None else children:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc_.kill()


def test_local_stack_started_on_a_full_redis_runs_every_accepted_job(tmp_path: Path, work_dir: Path) -> None:
    """`pipeline run` on a Redis at maxmemory (noeviction) that the typed producer filled until it refused a job:
    its workers start, run every accepted job (each result stored), and none of them loops on reconnects; the stack
    stays up (beat and Flower wait for room too). In this file: it uses the stack's fixed ports, as the test above."""
    node = full_node(tmp_path / "redis")
    producer = ProducerProcess(tmp_path / "producer.log", {"REDIS_URL": node.url}).start()
    stack = Command(
        pipeline_command("run", "--no-api"),
        tmp_path / "stack.log",
        {"REDIS_URL": node.url, "DATA_DIR": str(tmp_path / "data"), "LOCAL_WEBHOOK_PORT": str(free_port())},
    )
    try:
        accepted = fill(producer)
        assert len(accepted) > 300
        stack.start()
        client = node.client()
        wait_for(lambda: states(client, accepted)["SUCCESS"] == len(accepted), 90, 0.5, what="every accepted job")
        assert states(client, accepted) == {"SUCCESS": len(accepted)}
        assert stack.running()
        log = stack.log()
    finally:
        stack.stop()
        producer.stop()
        node.stop()
    assert "Connection to broker lost" not in log and "Frequent restarts" not in log, log[-3000:]
    assert "Redis is at maxmemory (" in log and "exited" not in log
