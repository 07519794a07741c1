"""REDIS_URL forms that must work end to end: rediss:// with certificate checks, and sentinel://.

Each test runs a real worker and a real producer (the `pipeline` command) against its own Redis
endpoint: a TLS-only redis-server with a throwaway CA, or a Sentinel watching the test Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_pipeline
from tests.support.procs import free_port, redis_binary, wait_for
from tests.support.topology import start_sentinel

pytestmark = pytest.mark.integration


def enqueue_probe(env: dict[str, str], timeout: int = 90) -> subprocess.CompletedProcess[str]:
    probe = ["enqueue", "probe", "--set", "message=over-the-wire", "--wait", "--json", "--timeout", "60"]
    return run_pipeline(*probe, env={**os.environ, **env}, timeout=timeout)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=pipeline-test-ca",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
        cwd=tmp_path,
    )
    (tmp_path / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "ext",
        cwd=tmp_path,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            "server.crt",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.crt",
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                subprocess.run(
                    ["redis-cli", "--tls", "--cacert", "ca.crt", "-p", str(port), "ping"],
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                == "PONG"
            ),
            15,
            0.2,
            what="TLS redis-server",
        )
        yield port, tmp_path / "ca.crt"
    finally:
        proc.terminate()
        proc.wait(10)


def test_rediss_url_with_verified_certificate_runs_jobs(tls_redis: tuple[int, Path], make_worker: Any) -> None:
    port, ca = tls_redis
    env = {"REDIS_URL": f"rediss://localhost:{port}/0", "REDIS_TLS_CA_FILE": str(ca)}
    make_worker("tls", env=env, concurrency=1)
    proc = enqueue_probe(env)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["state"] == "succeeded"
    assert status["result"]["message"] == "over-the-wire"


def test_rediss_refuses_a_server_it_cannot_verify(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "queues"],
        env={**os.environ, "REDIS_URL": f"rediss://localhost:{port}/0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 3
    assert "certificate verify failed" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def sentinel(redis_server: Any, tmp_path: Path) -> Iterator[int]:
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\nsentinel monitor pipemaster 127.0.0.1 {redis_server.port} 1\n"
        "sentinel down-after-milliseconds pipemaster 60000\n"
    )
    proc = start_sentinel(conf)
    try:
        import redis

        client = redis.Redis(port=port)
        wait_for(lambda: _master(client), 15, 0.2, what="sentinel to know its master")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _master(client: Any) -> bool:
    try:
        return bool(client.sentinel_get_master_addr_by_name("pipemaster"))
    except Exception:  # noqa: BLE001 - not up yet
        return False


def test_sentinel_url_runs_jobs(sentinel: int, make_worker: Any) -> None:
    # Database 3 keeps this worker's queues apart from the session worker's.
    env = {
        "REDIS_URL": f"sentinel://127.0.0.1:{sentinel}/3;sentinel://127.0.0.1:{sentinel}/3",
        "REDIS_SENTINEL_MASTER": "pipemaster",
    }
    make_worker("sentinel", env=env, concurrency=1)
    proc = enqueue_probe(env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == "succeeded"
