"""Every Celery-side reach into a library's internals, in one package, each with the test that proves it still holds.

The pipeline replaces or reads a few internals of Celery, kombu, celery-redbeat, redis-py and Flower, for speed (the
worker's per-job path) or for what no public API gives (kombu's envelope of a publish, recorded unsent; Flower's
broker client on a cluster). Each one lives in a module of this package, and `ENTRIES` names, for each, the upstream
symbol, the libraries it depends on and its parity test: a test that compares it against upstream's own behaviour
computed at test time, so that it fails when an upgrade changes upstream. The worker's Redis delivery layer keeps its
own table (`pipeline.delivery.ENTRIES`). Everywhere else the pipeline uses public APIs only
(`tests/unit/test_seam.py` checks it).

`versions` holds the ranges every entry was verified on (the project's own requirements) and the guard built on them:

* a speed-only replacement (`critical=False`) runs only on verified versions (`enabled`, checked once per process
  or per object, not per job); elsewhere Celery's or kombu's own path runs, after one WARNING;
* what delivery depends on (`critical=True`) makes the process refuse to start on unverified versions
  (`versions.require`): beat (`BEAT_LIBRARIES`, when its scheduler is built), the API and the CLI, which write
  jobs themselves (`PRODUCER_LIBRARIES`, at start), and the worker (its delivery layer, at start), unless
  ALLOW_UNVERIFIED_VERSIONS=true.

Importing this package imports none of its modules: each is imported where it is used.
"""

from __future__ import annotations

from functools import cache

from pipeline.compat import versions
from pipeline.compat.versions import GUARDED, Entry

__all__ = ["BEAT_LIBRARIES", "ENTRIES", "PRODUCER_LIBRARIES", "enabled", "libraries"]

_UNIT = "tests/unit"
_INTEGRATION = "tests/integration"

ENTRIES: tuple[Entry, ...] = (
    Entry(
        upstream="celery.worker.strategy.default, WorkController._process_task, Request.execute_using_pool,"
        " BasePool.apply_async, BasePool._does_debug",
        where="pipeline.compat.strategy",
        libraries=("celery",),
        test=f"{_INTEGRATION}/test_solo_strategy.py::test_the_direct_path_runs_a_job_as_celerys_handler_does",
    ),
    Entry(
        upstream="celery.events.dispatcher.EventDispatcher.send (its group filter)",
        where="pipeline.compat.events",
        libraries=("celery",),
        test=f"{_UNIT}/test_compat.py::test_task_events_on_answers_as_the_dispatcher_sends",
    ),
    Entry(
        upstream="celery.app.task.Context._get_custom_headers",
        where="pipeline.compat.context",
        libraries=("celery",),
        test=f"{_UNIT}/test_context_headers.py::test_custom_headers_are_celerys_for_any_request",
    ),
    Entry(
        upstream="celery._state.push_current_task, pop_current_task (celery.current_task's stack)",
        where="pipeline.compat.currenttask",
        libraries=("celery",),
        test=f"{_UNIT}/test_compat.py::test_a_task_pushed_on_another_thread_is_its_current_task_as_celerys_call_makes_it",
    ),
    Entry(
        upstream="celery.app.trace.saferepr",
        where="pipeline.compat.resultrepr",
        libraries=("celery",),
        test=f"{_UNIT}/test_result_repr.py::test_plain_data_reads_as_celerys_saferepr",
    ),
    Entry(
        upstream="kombu.utils.json.loads (kombu.serialization.registry's application/json decoder)",
        where="pipeline.compat.serialization",
        libraries=("kombu",),
        test=f"{_UNIT}/test_serialization.py::test_loads_is_kombus_for_any_encoded_value",
    ),
    Entry(
        upstream="celery.backends.base.BaseKeyValueStoreBackend._store_result (Redis: GET, then SETEX and PUBLISH)",
        where="pipeline.compat.results",
        libraries=("celery", "redis"),
        test=f"{_INTEGRATION}/test_compat_parity.py::test_a_state_is_stored_as_celerys_backend_stores_it",
    ),
    Entry(
        upstream="celery.backends.asynchronous.AsyncBackendMixin._wait_for_pending (Drainer.drain_events_until's"
        " on_interval: AsyncResult.get()'s read of the result's parents)",
        where="pipeline.compat.resultwait",
        libraries=("celery",),
        test=f"{_INTEGRATION}/test_chord_errors.py::test_stock_celerys_get_raises_the_chords_error_there",
    ),
    Entry(
        upstream="celery.backends.redis.RedisBackend.client (every command of the backend goes through it), ._set"
        " (called by .set after its size check, _MAX_STR_VALUE_SIZE)",
        where="pipeline.compat.clusterresults",
        libraries=("celery", "redis"),
        test=f"{_INTEGRATION}/test_cluster_reads.py::test_results_stored_and_read_through_the_cluster_backend",
        critical=True,
    ),
    Entry(
        upstream="celery.backends.base.Backend._get_result_meta",
        where="pipeline.compat.results",
        libraries=("celery",),
        test=f"{_UNIT}/test_result_meta.py::test_the_meta_is_celerys",
    ),
    Entry(
        upstream="celery.backends.base.Backend.encode, kombu.serialization.registry._encoders",
        where="pipeline.compat.results",
        libraries=("celery", "kombu"),
        test=f"{_UNIT}/test_result_meta.py::test_a_result_is_encoded_as_celery_encodes_it",
    ),
    Entry(
        upstream="redbeat.schedulers.RedBeatScheduler.tick, .maybe_due, ._maybe_due_kwargs",
        where="pipeline.compat.redbeat",
        libraries=("celery", "celery-redbeat"),
        test=f"{_INTEGRATION}/test_compat_parity.py::test_a_tick_sends_what_redbeats_tick_sends",
        critical=True,
    ),
    Entry(
        upstream="redbeat.schedulers.acquire_distributed_beat_lock (LUA_EXTEND_TO_SCRIPT, get_redis,"
        " redis.lock.Lock.lua_extend)",
        where="pipeline.compat.redbeat",
        libraries=("celery-redbeat", "redis"),
        test=f"{_INTEGRATION}/test_compat_parity.py::test_the_lock_is_the_one_redbeat_takes",
        critical=True,
    ),
    Entry(
        upstream="redbeat.schedulers.RedBeatSchedulerEntry._next_instance (an entry's run: its `meta` field and its"
        " score in the schedule ZSET), RedBeatScheduler.reserve; redis.lock.Lock.lua_extend, .local.token",
        where="pipeline.compat.redbeat",
        libraries=("celery-redbeat", "redis"),
        test=f"{_INTEGRATION}/test_beat_replicas.py::test_a_run_and_a_renewal_are_written_as_redbeat_writes_them",
        critical=True,
    ),
    Entry(
        upstream="redbeat.schedulers.get_redis (the client it keeps on the app: REDBEAT_REDIS_KEY, RetryingConnection"
        " when retry_period is set)",
        where="pipeline.compat.redbeat",
        libraries=("celery-redbeat",),
        test=f"{_UNIT}/test_redbeat_client.py::test_get_redis_returns_the_installed_client_wrapped_as_its_own",
        critical=True,
    ),
    Entry(
        upstream="flower.views.BaseHandler.get_broker, flower.utils.broker.RedisBase.queues (its answer)",
        where="pipeline.compat.flowerbroker",
        libraries=("flower",),
        test=f"{_INTEGRATION}/test_flower.py::test_flower_on_a_cluster_url_shows_queue_lengths_as_on_a_single_redis",
    ),
    Entry(
        upstream="kombu.transport.redis.Channel._put (its LPUSH and PEXPIREs: _q_for_pri, _get_message_priority,"
        " _expires; the _publish_batch keyword), Channel._do_restore_message's pushes (pipe.lpush, pipe.rpush)",
        where="pipeline.compat.marking",
        libraries=("kombu", "redis"),
        test="tests/faults/test_wake.py::test_a_marked_publish_writes_what_kombu_writes_and_the_queues_marker",
        critical=True,
    ),
    Entry(
        upstream="kombu.messaging.Producer._batch_local, kombu.transport.redis.Channel._put(_publish_batch=)",
        where="pipeline.compat.batch",
        libraries=("kombu",),
        test=f"{_INTEGRATION}/test_compat_parity.py::test_a_recorded_publish_is_what_kombu_writes",
        critical=True,
    ),
    Entry(
        upstream="kombu.transport.virtual.base.Message._raw",
        where="pipeline.compat.message",
        libraries=("kombu",),
        test=f"{_UNIT}/test_compat.py::test_the_raw_envelope_is_what_kombu_writes_back",
        critical=True,
    ),
    Entry(
        upstream="celery.app.amqp.AMQP.as_task_v2 in kombu's Redis envelope (a templated job's bytes)",
        where="pipeline.producer.template",
        libraries=("celery", "kombu"),
        test=f"{_INTEGRATION}/test_enqueue_path.py::test_a_templated_message_is_byte_for_byte_the_one_celery_builds",
        critical=True,
    ),
    Entry(
        upstream="celery.app.amqp.AMQP.as_task_v2's argsrepr (celery.utils.saferepr.saferepr)",
        where="pipeline.producer.template",
        libraries=("celery",),
        test=f"{_UNIT}/test_producer_template.py::test_argsrepr_is_celerys_saferepr",
    ),
)

#: What the API and the CLI refuse to start without at a verified version: they write jobs themselves (Celery's
#: message in kombu's envelope, recorded through kombu's batch hook, onto kombu's Redis layout through redis-py).
PRODUCER_LIBRARIES = ("celery", "kombu", "redis")
#: What beat refuses to start without at a verified version: redbeat's scheduler and lock (Celery's beat, redis-py's
#: `Lock`), and the delayed jobs it releases onto kombu's queues.
BEAT_LIBRARIES = ("celery", "kombu", "celery-redbeat", "redis")


@cache
def libraries(where: str) -> tuple[str, ...]:
    """The distributions the entries held in module `where` depend on, in `GUARDED`'s order."""
    named = {name for entry in ENTRIES if entry.where == where for name in entry.libraries}
    return tuple(name for name in GUARDED if name in named)


def enabled(where: str) -> bool:
    """Whether the speed-only replacements in module `where` may run: every library they depend on is at a verified
    version (`versions.enabled`: decided once per process, one WARNING when not)."""
    return versions.enabled(where, libraries(where))
