"""What Celery, kombu and redbeat are told, derived from `Settings`: the only place lowercase Celery keys appear.

Reference: https://docs.celeryq.dev/en/stable/userguide/configuration.html
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from kombu import Queue

from pipeline.config import cluster
from pipeline.config.beat import maintenance_entries
from pipeline.config.cluster import is_cluster
from pipeline.config.settings import Settings
from pipeline.constants import BEAT_CLUSTER_KEY_PREFIX, BEAT_KEY_PREFIX, LONG_JOB_QUEUES, ROUTES, WORK_QUEUES


def is_sentinel(broker_url: str) -> bool:
    """Whether the broker is reached through Sentinel: the scheme of the first of several `;`-separated URLs. A
    worker consumes through the matching class of the delivery layer's transport (`pipeline.delivery.transport`)."""
    return urlsplit(broker_url.split(";")[0]).scheme == "sentinel"


#: What a worker adds to `celery_conf` (`pipeline.runtime.worker`): a job that finishes while Redis is down keeps
#: its lease and stores its result once Redis is back, retried every ~1 s (full jitter up to 2 s) for about ten
#: minutes, then dead-lettered with BackendStoreError. Producers keep 10 quick retries, so an API request fails
#: fast (503) instead.
WORKER_RESULT_RETRIES: dict[str, Any] = {
    "result_backend_max_retries": 600,
    "result_backend_base_sleep_between_retries_ms": 100,
    "result_backend_max_sleep_between_retries_ms": 2000,
}
#: Deliveries one sweep restores at most (a dead worker's prefetch is far below this).
UNACKED_RESTORE_LIMIT = 1000
#: Scheme → result backend class (`pipeline.compat.results`), for `Celery.loader.override_backends`.
BACKENDS = {
    "redis": "pipeline.compat.results:RedisBackend",
    "rediss": "pipeline.compat.results:RedisBackend",
    "sentinel": "pipeline.compat.results:SentinelBackend",
    # A Redis Cluster (`result_backend_name`): the name carries no URL, whose several seeds Celery cannot parse.
    "rediscluster": "pipeline.compat.clusterresults:ClusterBackend",
}

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def result_backend_name(settings: Settings) -> str:
    """Celery's `result_backend`: the results' URL, or on a Redis Cluster the cluster backend's name (its client
    takes the seeds from the settings: `pipeline.compat.clusterresults`)."""
    return "rediscluster" if is_cluster(settings.result_url) else settings.result_url


def _ssl_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[settings.redis_tls_cert_reqs]}
    if settings.redis_tls_ca_file is not None:
        options["ssl_ca_certs"] = str(settings.redis_tls_ca_file)
    return options


def _transport_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {
        # The lease (`pipeline.delivery.lease`): a delivery not renewed for this long is restored by the sweep.
        "visibility_timeout": settings.lease_seconds,
        # kombu 5.7: how often a worker sweeps for expired leases (throttle 1 = every interval), and how many
        # it restores per sweep: a dead worker's whole prefetch at once.
        "unacked_restore_interval": settings.unacked_restore_interval,
        "unacked_restore_throttle": 1,
        "unacked_restore_limit": UNACKED_RESTORE_LIMIT,
        # A dead connection is noticed within seconds instead of hanging the consumer.
        "health_check_interval": 10,
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "retry_on_timeout": True,
    }
    if settings.redis_sentinel_master:
        options["master_name"] = settings.redis_sentinel_master
        options["sentinel_kwargs"] = sentinel_kwargs(settings)
    return options


#: Longest wait for one Sentinel (connect or answer) while looking up the primary: a Sentinel host that is down or
#: cut off is passed over for the next in a second or two, not after the broker's 30 s socket timeout.
SENTINEL_TIMEOUT_S = 2.0
#: Longest wait for one answer of Redis to beat (redbeat's client has none by default: a primary cut off without a
#: reset would hang beat's tick for good).
BEAT_SOCKET_TIMEOUT_S = 10.0


def sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    """How the clients talk to the Sentinels themselves (redis-py's `Sentinel(sentinel_kwargs=...)`): short timeouts,
    and REDIS_SENTINEL_PASSWORD when set. (Given no `sentinel_kwargs`, redis-py reuses the data connection's socket
    options; given some, only those: so the timeouts are always set here.)"""
    options: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "socket_keepalive": True,
    }
    if settings.redis_sentinel_password is not None:
        options["password"] = settings.redis_sentinel_password.get_secret_value()
    return options


def celery_conf(settings: Settings) -> dict[str, Any]:
    """Celery's configuration for these settings. The only place lowercase Celery keys appear.

    Reference: https://docs.celeryq.dev/en/stable/userguide/configuration.html
    """
    transport = _transport_options(settings)
    conf: dict[str, Any] = {
        "broker_url": settings.broker_url,
        "result_backend": result_backend_name(settings),
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "visibility_timeout": settings.lease_seconds,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "broker_channel_error_retry": True,
        # JSON only: pickle (code execution) and every other content type is refused by the worker.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "enable_utc": True,
        "timezone": "UTC",
        # At-least-once: ack after the task ran; a killed pool child is retried (counted against max_retries).
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_retry_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_soft_time_limit": settings.task_soft_time_limit,
        "task_time_limit": settings.task_time_limit,
        # STARTED is stored only by tasks that report progress (`track_started=True`: pdf, transcode); it costs
        # a read and a write per job. Task events only when something consumes them (`pipeline.runtime.events`).
        "task_track_started": False,
        "task_send_sent_event": settings.task_events,
        "worker_send_task_events": settings.task_events,
        "result_expires": settings.result_expires,
        "result_extended": True,
        "result_backend_always_retry": True,
        # Producers (API, CLI) give up quickly; workers wait much longer (`WORKER_RESULT_RETRIES`).
        "result_backend_max_retries": 10,
        "task_default_queue": WORK_QUEUES[0],
        "task_queues": [Queue(name, routing_key=name) for name in WORK_QUEUES],
        # A job sent without a priority gets the default: `Task.apply_async` through task_default_priority,
        # `send_task` through its route (an explicit priority wins over both; `pipeline.queues.priority`).
        "task_default_priority": settings.task_default_priority,
        "task_routes": task_routes(settings),
        # The `short` profile's until the worker knows its queues (`pipeline.runtime.worker.Worker.setup_queues`).
        "worker_prefetch_multiplier": prefetch_multiplier(settings, "short"),
        # Bounded stop: SIGTERM (remapped to SIGQUIT by the start scripts) waits this long, then requeues.
        "worker_soft_shutdown_timeout": settings.worker_soft_shutdown_timeout,
        # Idle workers stop at once; `pipeline.runtime.worker` still waits for jobs held with an ETA.
        "worker_enable_soft_shutdown_on_idle": False,
        # Leases keep a running job ours through an outage: it goes on and is acknowledged once Redis is back.
        # (Cancelling it lost jobs: celery/celery#7185, celery/celery#8541.)
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_consumer": "pipeline.dlq.consumer:DeadLetteringConsumer",
        "worker_hijack_root_logger": False,
    }
    conf.update(beat_conf(settings))
    conf["task_annotations"] = task_annotations(settings)
    if settings.worker_max_memory_per_child:
        conf["worker_max_memory_per_child"] = settings.worker_max_memory_per_child
    if settings.broker_url.startswith("rediss://"):
        conf["broker_use_ssl"] = _ssl_options(settings)
    if settings.result_url.startswith("rediss://"):
        conf["redis_backend_use_ssl"] = _ssl_options(settings)
    if is_cluster(settings.broker_url):
        conf.update(cluster_broker(settings))
    return conf


#: The transport on a Redis Cluster (`pipeline.delivery.clustered`): producers use it as it is, a worker a subclass
#: bound to its leases.
CLUSTER_TRANSPORT = "pipeline.delivery.clustered:ClusterTransport"


def cluster_broker(settings: Settings) -> dict[str, Any]:
    """What Celery is told on a Redis Cluster URL: the pipeline's cluster transport, and a broker URL kombu can parse
    (kombu reads `redis+cluster://` as its own Redis transport and the seed list as one port). The transport's
    channel reaches the cluster through `pipeline.cluster` (every seed, credentials, TLS), not through that URL."""
    seed = urlsplit(cluster.seed_url(settings.broker_url)).netloc.rpartition("@")[2]  # host:port, IPv6 in brackets
    return {"broker_url": f"rediscluster://{seed}/0", "broker_transport": CLUSTER_TRANSPORT}


#: Jobs each pool process reserves ahead, per worker profile: short jobs keep the pool busy between round
#: trips; a long job reserved behind another would wait for it (and a reserved job is one a scale-down requeues).
PROFILE_PREFETCH: dict[str, int] = {"short": 4, "long": 1}


def worker_profile(settings: Settings, queues: Iterable[str]) -> str:
    """`short` or `long`: WORKER_PROFILE, or with `auto`, long when `queues` hold a long-job queue."""
    if settings.worker_profile != "auto":
        return settings.worker_profile
    return "long" if set(queues) & set(LONG_JOB_QUEUES) else "short"


def prefetch_multiplier(settings: Settings, profile: str) -> int:
    """WORKER_PREFETCH_MULTIPLIER when set, else the profile's."""
    return settings.worker_prefetch_multiplier or PROFILE_PREFETCH[profile]


def task_routes(settings: Settings) -> dict[str, dict[str, Any]]:
    """ROUTES, each with the default priority, then every other task on the default queue with it too (a route's
    options are defaults: a caller's own queue or priority wins)."""
    routes = {pattern: {"queue": queue} for pattern, queue in ROUTES.items()}
    routes["*"] = {"queue": WORK_QUEUES[0]}
    return {pattern: {**route, "priority": settings.task_default_priority} for pattern, route in routes.items()}


def task_annotations(settings: Settings) -> dict[str, dict[str, Any]]:
    """Per-task options that come from settings. Celery applies annotations over a task's own options when it
    binds to the app, so they need no code change and task modules read no setting at import."""
    annotations: dict[str, dict[str, Any]] = {
        "media.transcode": {
            "soft_time_limit": settings.transcode_soft_time_limit,
            "time_limit": settings.transcode_time_limit,
        }
    }
    for name, rate in settings.task_rate_limits.items():
        annotations.setdefault(name, {})["rate_limit"] = rate
    return annotations


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Maintenance entries, then the deployment's BEAT_SCHEDULE (a user entry may replace one by name)."""
    entries = maintenance_entries()
    entries.update({name: entry.as_celery() for name, entry in settings.beat_schedule.items()})
    return entries


def beat_conf(settings: Settings) -> dict[str, Any]:
    """Celery and redbeat settings for beat (merged into `celery_conf`)."""
    url = settings.broker_url
    options: dict[str, Any] = {"retry_period": settings.beat_lock_timeout, "socket_timeout": BEAT_SOCKET_TIMEOUT_S}
    if is_cluster(url):  # shown in beat's banner only: its client is `pipeline.compat.redbeat.use_cluster`'s
        host, port = cluster.parse(url).seeds[0]
        url = f"redis-cluster://{host}:{port}/0"
    elif settings.redis_sentinel_master:  # redbeat's own sentinel form
        parts = [urlsplit(part) for part in settings.broker_url.split(";")]
        url = "redis-sentinel://"
        options.update(
            sentinels=[(part.hostname, part.port or 26379) for part in parts],
            service_name=settings.redis_sentinel_master,
            password=parts[0].password,
            sentinel_kwargs=sentinel_kwargs(settings),
        )
    return {
        "beat_schedule": beat_schedule(settings),
        # redbeat's scheduler, made to survive Redis outages (see pipeline/compat/redbeat.py).
        "beat_scheduler": "pipeline.compat.redbeat:Scheduler",
        "beat_max_loop_interval": settings.beat_max_loop_interval,
        "redbeat_redis_url": url,
        "redbeat_redis_options": options,
        # On a cluster every key under one tag; redbeat's client there is `pipeline.compat.redbeat.use_cluster`'s.
        "redbeat_key_prefix": BEAT_CLUSTER_KEY_PREFIX if is_cluster(settings.broker_url) else BEAT_KEY_PREFIX,
        "redbeat_lock_timeout": settings.beat_lock_timeout,
    }
