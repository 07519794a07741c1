"""The delivery layer: how a worker takes jobs from Redis, holds them under a lease and settles them.

One kombu transport (`transport`: the Redis `Channel` and `QoS` subclassed) with its fetch (`fetch`: one Lua script
pops and records up to a prefetch of messages), leases and their renewal (`lease`: one `Leases` object per worker),
acknowledgements written together (`acks`), and fencing (`fencing`: the worker bootstep that owns the `Leases`;
`request`: the job request that refuses a lost delivery). Its Redis scripts are files in `pipeline.lua`
(`fetch.lua`, `settle.lua`, `renew.lua`, `release.lua`); `waking` is how an idle channel waits for work
(`pipeline.queues.wake`), `watches` how it hears a message pushed without a wake-up marker, `broadcasts` how Celery's
revoke broadcast is read off the worker's main thread. On a Redis Cluster the worker consumes through `clustered`
instead (per-queue fetch, leases and restores; `cluster_fanout` for Celery's control and events; `cluster_loop` for
kombu's event loop; `moving` for a queue whose slot is moving between two masters).

This package and `pipeline.compat` are the only places that reach into private parts of celery, kombu, billiard and
redis-py (`tests/unit/test_seam.py` fails on any other). Each reach is an entry of `ENTRIES`: the upstream symbols,
where, the libraries it was verified on (`pipeline.compat.versions.verified()`) and the test that proves, against
upstream at test time, that it still holds. All are delivery-critical: a worker on a version outside the verified
ranges refuses to start (`fencing.DeliveryStep`).
"""

from __future__ import annotations

from pipeline.compat.versions import Entry

_KOMBU = ("kombu", "redis")
_WORKER = ("celery", "kombu", "billiard")

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "kombu.transport.virtual.Channel._get_many, _get, _put, _lookup, _queue_bind, _put_fanout, supports_fanout, "
        "_get_message_priority, get_table, drain_events; QoS._delivered; Transport._deliver, implements (the "
        "transport on a Redis Cluster)",
        "pipeline.delivery.clustered, pipeline.delivery.cluster_fanout",
        _KOMBU,
        "tests/integration/test_cluster_worker.py::test_a_worker_drains_queues_on_two_masters_each_job_once",
        critical=True,
    ),
    Entry(
        "kombu.transport.virtual.Transport.channels, implements.asynchronous, register_with_event_loop, "
        "close_connection, Channel._active_queues, closed; kombu.asynchronous.hub.Hub.on_tick, add_reader, "
        "remove_reader, call_repeatedly; redis.connection.AbstractConnection._sock of a PubSub's connection (the "
        "cluster transport on the worker's event loop)",
        "pipeline.delivery.cluster_loop, pipeline.delivery.clustered",
        _KOMBU,
        "tests/integration/test_cluster_worker.py::test_the_event_loop_polls_the_subscription_socket_and_wakes_on_a_marker",
        critical=True,
    ),
    Entry(
        "redis.cluster.RedisCluster.RedisClusterRequestTTL, read from the instance at each call (a worker channel's "
        "client gives up on a moving slot after a few tries), ClusterError once the tries are spent",
        "pipeline.delivery.moving",
        ("redis",),
        "tests/faults/test_cluster_moving_slot.py::test_a_worker_channels_client_gives_up_on_a_moving_slot_after_its_tries",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.Channel._brpop_start, _brpop_read, _get, _q_for_pri, _queue_cycle, "
        "Transport._deliver (the fetch inside kombu's poll cycle)",
        "pipeline.delivery.transport, pipeline.delivery.fetch",
        _KOMBU,
        "tests/faults/test_delivery_parity.py::test_the_fetch_delivers_and_records_what_kombu_does",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.QoS.restore_by_tag, restore_unacked, restore_unacked_once, restore_visible, "
        "_delivered, _on_collect, _flush; Channel._do_restore_message",
        "pipeline.delivery.transport",
        _KOMBU,
        "tests/faults/test_delivery_parity.py::test_a_requeued_delivery_is_back_as_kombu_puts_it_back",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.Channel._connparams, _create_client (a closed connection raises a connection error)",
        "pipeline.delivery.transport, pipeline.delivery.acks",
        _KOMBU,
        "tests/faults/test_broker_outage.py::test_a_channel_closed_after_its_connection_keeps_its_deliveries_leased",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.Channel._queue_bind, _delete, _size, maybe_refresh_binding_expiry, keyprefix_queue, "
        "sep (a worker starts on a full Redis, and binds what it skipped once Redis has room)",
        "pipeline.delivery.full",
        _KOMBU,
        "tests/ha/test_full_redis.py::test_a_binding_in_place_is_kept_on_a_full_redis_as_kombu_writes_it",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.Channel.close, _in_poll, _closing (a close reads the fetch in flight first; the "
        "channel fetches no more once closing)",
        "pipeline.delivery.transport, pipeline.delivery.acks",
        _KOMBU,
        "tests/faults/test_delivery_parity.py::test_kombus_close_reads_the_fetch_in_flight_first_and_marks_closing",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.MultiChannelPoller._register, _fd_to_chan, _chan_to_sock, _unregister_from_poll, "
        "on_readable; Channel.handlers, async_pool (a watch on a queue list in kombu's poll cycle)",
        "pipeline.delivery.watches",
        _KOMBU,
        "tests/faults/test_delivery_parity.py::test_kombus_poller_registers_and_reads_a_watch_as_the_watches_drive_it",
        critical=True,
    ),
    Entry(
        "kombu.asynchronous.hub.Hub._loop_thread (an acknowledgement is deferred only on the event loop's thread)",
        "pipeline.delivery.acks",
        ("kombu",),
        "tests/faults/test_delivery_parity.py::test_the_loop_thread_is_the_hubs",
        critical=True,
    ),
    Entry(
        "kombu.asynchronous.hub.Hub._ready, _ready_lock; celery.worker.consumer.Consumer.call_soon_ack (a job's "
        "acknowledgement waits there for the loop's next iteration: landed at a shutdown before the connection closes)",
        "pipeline.delivery.acks",
        ("celery", "kombu"),
        "tests/faults/test_delivery_parity.py::test_celerys_scheduled_acknowledgement_is_what_land_runs_at_a_shutdown",
        critical=True,
    ),
    Entry(
        "celery.worker.request.Request._message, _eventer, _context, _body, _content_type, _content_encoding, "
        "_already_cancelled, _announce_revoked, _announce_cancelled, _apply_result, _terminate_on_ack",
        "pipeline.delivery.request, pipeline.delivery.fencing",
        _WORKER,
        "tests/faults/test_delivery_parity.py::test_celerys_request_has_what_the_delivery_layer_reads",
        critical=True,
    ),
    Entry(
        "billiard.pool.ApplyResult._ack, _set_terminated; the prefork pool's _pool.outbound_buffer",
        "pipeline.delivery.fencing",
        _WORKER,
        "tests/faults/test_delivery_parity.py::test_billiards_result_is_accepted_and_terminated_as_fencing_drives_it",
        critical=True,
    ),
    Entry(
        "billiard.pool.Pool._cache, ApplyResult._accepted, _job; celery.concurrency.asynpool's job._write_to (the "
        "jobs in a process's pipe that Celery's flush after a lost connection forgets, put back after it)",
        "pipeline.delivery.handed, pipeline.delivery.fencing",
        _WORKER,
        "tests/faults/test_restart_acks.py::test_a_job_in_a_pool_process_pipe_at_a_redis_restart_is_acknowledged_once_it_ran",
        critical=True,
    ),
    Entry(
        "kombu.transport.redis.Channel.keyprefix_fanout, _get_publish_topic; kombu.pidbox.Mailbox._publish, "
        "Node.handle_message (Celery's revoke broadcast: its topic, envelope and destination, read beside the worker's "
        "control consumer)",
        "pipeline.delivery.broadcasts",
        ("celery", "kombu"),
        "tests/faults/test_delivery_parity.py::test_celerys_revoke_broadcast_is_read_on_the_topic_kombu_publishes_it",
        critical=True,
    ),
    Entry(
        "kombu.connection.Connection.switch (resets transport_cls to the next URL's scheme; the transport is built "
        "anew from transport_cls), Connection.clone, celery.app.amqp.AMQP.Connection",
        "pipeline.delivery.failover",
        ("celery", "kombu"),
        "tests/integration/test_transport_switch.py::test_a_switch_keeps_the_bound_transport_and_is_kombus_otherwise",
        critical=True,
    ),
)
