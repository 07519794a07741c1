"""The queues the app routes to (`pipeline.queues.routed`), what the per-queue loops walk on a Redis Cluster: the work
queues first, then a task's own queue and the queues a worker consumes, each once.

The apps here are Celery apps of their own with the pipeline's configuration; typed tasks are shared tasks, so one
attaches those the test process imported before (a test's own queues among them): the checks are on what is added."""

from __future__ import annotations

from celery import Celery

from pipeline.config import get_settings
from pipeline.config.celery import celery_conf
from pipeline.constants import WORK_QUEUES
from pipeline.queues.routed import routed_queues


def _app() -> Celery:
    app = Celery("routed-test", set_as_current=False)
    app.conf.update(celery_conf(get_settings()))
    return app


def test_the_work_queues_come_first() -> None:
    assert routed_queues(_app())[: len(WORK_QUEUES)] == WORK_QUEUES


def test_a_task_s_own_queue_and_a_consumed_queue_are_walked_once() -> None:
    app = _app()
    before = routed_queues(app)

    @app.task(name="own.task", queue="own-queue")
    def own() -> None: ...

    @app.task(name="email.routed")
    def routed() -> None: ...

    assert routed_queues(app) == (*before, "own-queue")  # `email.routed` goes to `email`, listed already
    app.amqp.queues.select(["consumed-queue", "default"])  # `celery worker -Q consumed-queue,default`
    assert routed_queues(app) == (*before, "own-queue", "consumed-queue")


def test_a_task_registered_later_is_walked_from_then_on() -> None:
    app = _app()
    assert "later-queue" not in routed_queues(app)

    @app.task(name="later.task", queue="later-queue")
    def later() -> None: ...

    assert routed_queues(app)[-1] == "later-queue"


def test_a_name_a_cluster_refuses_is_left_out() -> None:
    """A queue named with a brace holds no key on a cluster (its enqueue fails): walking it would stop the walk."""
    app = _app()
    before = routed_queues(app)

    @app.task(name="braced.task", queue="{braced}")
    def braced() -> None: ...

    assert routed_queues(app) == before
