"""Settings: validated once, bad values stop the process with a message naming the variable."""

from __future__ import annotations

import ssl
import subprocess
import sys

import pytest

from pipeline.config import load_settings
from pipeline.config.celery import celery_conf, is_sentinel
from pipeline.errors import ConfigError


def test_defaults_give_reliable_celery_conf() -> None:
    conf = celery_conf(load_settings(redis_url="redis://localhost:6379/1"))
    assert conf["broker_url"] == conf["result_backend"] == "redis://localhost:6379/1"
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["task_soft_time_limit"] < conf["task_time_limit"]
    # The lease is the transport's visibility timeout: a delivery not renewed for LEASE_SECONDS is restored.
    assert conf["visibility_timeout"] == conf["broker_transport_options"]["visibility_timeout"] == 30
    assert conf["broker_transport_options"]["unacked_restore_interval"] == load_settings().unacked_restore_interval
    assert conf["broker_transport_options"]["unacked_restore_limit"] >= 1000
    assert conf["worker_cancel_long_running_tasks_on_connection_loss"] is False
    assert conf["worker_soft_shutdown_timeout"] > 0 and conf["broker_connection_retry_on_startup"]
    assert conf["result_expires"] > 0
    assert {q.name for q in conf["task_queues"]} == {"default", "email", "pdf", "transcode", "webhooks"}
    assert conf["task_routes"]["media.*"] == {"queue": "transcode", "priority": 3}
    # A job sent without a priority (apply_async, or send_task through the routes) waits one level below the top.
    assert conf["task_default_priority"] == conf["task_routes"]["*"]["priority"] == 3


def test_only_workers_consume_through_the_delivery_layers_transport() -> None:
    """Producers keep kombu's own; a worker's delivery bootstep binds `pipeline.delivery.transport` to its leases,
    the Sentinel class when the first of the broker URLs is a Sentinel one."""
    assert "broker_transport" not in celery_conf(load_settings(redis_url="redis://localhost:6379/1"))
    assert not is_sentinel("rediss://:pw@redis.example:6380/0")
    assert is_sentinel("sentinel://s1:26379;sentinel://s2:26379")


def test_unset_redis_url_means_the_embedded_dev_redis() -> None:
    settings = load_settings(redis_url=None, local_redis_port=6399)
    assert settings.broker_url == "redis://127.0.0.1:6399/0"


def test_rediss_checks_certificates_by_default() -> None:
    conf = celery_conf(load_settings(redis_url="rediss://:pw@redis.example:6380/0"))
    assert conf["broker_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert conf["redis_backend_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED


def test_sentinel_needs_master_name() -> None:
    with pytest.raises(ConfigError, match="REDIS_SENTINEL_MASTER"):
        load_settings(redis_url="sentinel://h1:26379;sentinel://h2:26379")
    conf = celery_conf(
        load_settings(redis_url="sentinel://h1:26379;sentinel://h2:26379", redis_sentinel_master="mymaster")
    )
    assert conf["broker_transport_options"]["master_name"] == "mymaster"
    assert conf["result_backend_transport_options"]["master_name"] == "mymaster"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"redis_url": "amqp://guest@localhost//"}, "REDIS_URL must start with redis://"),
        ({"task_soft_time_limit": 300, "task_time_limit": 300}, "TASK_SOFT_TIME_LIMIT"),
        ({"lease_seconds": 2}, "LEASE_SECONDS"),
        ({"retry_jitter": 1.5}, "RETRY_JITTER"),
        ({"email_attachments_max_bytes": 0}, "EMAIL_ATTACHMENTS_MAX_BYTES"),
        ({"email_attachments_max_bytes": 200 * 1024 * 1024}, "EMAIL_ATTACHMENTS_MAX_BYTES"),
    ],
)
def test_invalid_values_name_the_variable(overrides: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        load_settings(**overrides)


def test_invalid_env_stops_celery_with_one_clear_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "pipeline", "inspect", "ping"],
        env={"PATH": "/usr/bin:/bin", "REDIS_URL": "http://nope", "ENV_FILE": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "REDIS_URL must start with redis://" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_secrets_directory_supplies_values(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "redis_url").write_text("redis://:s3cret@vault-host:6379/2")
    monkeypatch.setenv("SECRETS_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL")
    assert load_settings().broker_url == "redis://:s3cret@vault-host:6379/2"
