"""`pipeline.compat`: the accessors compared with upstream at test time, and the version guard in one process.

A speed-only replacement on an unverified library version is left off with one WARNING, and really is off: Celery's
and kombu's own code stays in place. A process that depends on one for delivery refuses to start (exit status 2,
one line naming the library and both versions) unless ALLOW_UNVERIFIED_VERSIONS accepts the risk. The processes
that refuse (beat, the API, the CLI) are tested in `tests/unit/test_version_guard.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from celery.app import trace
from celery.app.task import Context
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.utils.imports import symbol_by_name
from celery.utils.saferepr import saferepr
from kombu import Connection
from kombu.transport.redis import Channel as RedisChannel
from kombu.transport.redis import QoS as RedisQoS
from kombu.utils import json as kombu_json
from packaging.specifiers import SpecifierSet

from pipeline import compat
from pipeline.compat import context, events, resultrepr, serialization, versions
from pipeline.compat.clusterresults import ClusterBackend
from pipeline.compat.events import task_events_on
from pipeline.compat.message import raw_envelope
from pipeline.compat.results import RedisBackend, SentinelBackend
from pipeline.config.celery import BACKENDS
from tests.support.compat import verified_as_installed


@pytest.fixture(autouse=True)
def _fresh_checks() -> Iterator[None]:
    """Every test decides `enabled` anew, and leaves nothing decided behind."""
    versions.reset()
    serialization.decoder.cache_clear()
    yield
    versions.reset()
    serialization.decoder.cache_clear()


@contextmanager
def unverified(monkeypatch: pytest.MonkeyPatch, distribution: str, version: str) -> Iterator[None]:
    """`distribution` reads as installed at `version`."""
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: version if name == distribution else real(name))
    yield


class _Publisher:
    """Stands in for the dispatcher's producer: records what it would publish."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def publish(self, event: Any, **_: Any) -> None:
        self.sent.append(event)


@pytest.mark.parity
def test_task_events_on_answers_as_the_dispatcher_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every state of Celery's own dispatcher, `task_events_on` is whether its `send` publishes a task event."""
    monkeypatch.setattr(events, "_verified", [])
    app = Celery("events-parity", broker="memory://", set_as_current=False)
    with verified_as_installed(), app.connection_for_write() as connection:
        dispatcher = app.events.Dispatcher(connection, enabled=True)
        publisher = _Publisher()
        dispatcher.producer = publisher
        for enabled in (True, False):
            for groups in (set(), {"task"}, {"worker"}, {"worker", "task"}):
                dispatcher.enabled, dispatcher.groups = enabled, set(groups)
                publisher.sent.clear()
                dispatcher.send("task-received", uuid="job-1")
                assert task_events_on(dispatcher) == bool(publisher.sent), (enabled, groups)
    assert task_events_on(None) is False


def test_on_an_unverified_celery_task_events_are_left_to_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "_verified", [])

    class Eventer:
        enabled, groups = True, {"worker"}

    with unverified(monkeypatch, "celery", "9.0.0"):
        assert task_events_on(Eventer()) is True  # the dispatcher drops it, as in Celery
    Eventer.enabled = False
    assert task_events_on(Eventer()) is False


class _Pipe:
    """Stands in for a redis-py pipeline: records the commands."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def command(*args: Any) -> _Pipe:
            self.commands.append((name, args))
            return self

        return command

    def execute(self) -> list[Any]:
        return []


class _RedisChannel:
    """What kombu's Redis QoS reads of its channel to record a delivery."""

    unacked_key, unacked_index_key, do_restore = "unacked", "unacked_index", False

    def __init__(self) -> None:
        self.pipe = _Pipe()

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        class Client:
            pipeline = staticmethod(lambda: self.pipe)

        yield Client()


@pytest.mark.parity
def test_the_raw_envelope_is_what_kombu_writes_back() -> None:
    """kombu's Redis QoS records a delivery with the envelope the message was decoded from: `raw_envelope` is that
    envelope, the same keys in the same order, compression header included."""
    with Connection("memory://") as connection:
        queue = connection.SimpleQueue("raw-envelope-parity")
        queue.put({"n": 1, "text": "é"}, headers={"x-trace": "t"}, compression="zlib")
        message = queue.get(timeout=1)
        assert type(message) is RedisChannel.Message  # the class kombu's Redis channel builds its messages with
        channel = _RedisChannel()
        RedisQoS(channel).append(message, "tag-1")
        queue.close()
    (stored,) = [args[2] for name, args in channel.pipe.commands if name == "hset"]
    envelope, exchange, routing_key = json.loads(stored)
    assert kombu_json.dumps(raw_envelope(message)) == kombu_json.dumps(envelope)
    assert (exchange, routing_key) == (message.delivery_info["exchange"], message.delivery_info["routing_key"])
    assert raw_envelope(message)["headers"]["compression"] == "application/x-gzip"


def test_an_unverified_library_leaves_a_speed_only_replacement_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with unverified(monkeypatch, "celery", "5.8.0"), caplog.at_level(logging.WARNING, logger=versions.__name__):
        assert compat.enabled(context.__name__) is False
        assert compat.enabled(context.__name__) is False  # decided once: no second warning
    (record,) = [r for r in caplog.records if r.name == versions.__name__]
    message = record.getMessage()
    assert context.__name__ in message and "celery 5.8.0" in message and versions.verified()["celery"] in message


def test_on_an_unverified_library_celerys_and_kombus_own_code_stays_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "saferepr", saferepr)
    context.uninstall()
    with unverified(monkeypatch, "celery", "5.8.0"), unverified(monkeypatch, "kombu", "5.8.0"):
        context.install()
        resultrepr.install()
        assert Context._get_custom_headers is context.CELERY_CUSTOM_HEADERS  # type: ignore[attr-defined]
        assert trace.saferepr is saferepr  # type: ignore[attr-defined]
        assert serialization.decoder() is kombu_json.loads
        backend = RedisBackend(app=Celery("unverified", set_as_current=False), url="redis://127.0.0.1:1/0")
        value = {"ok": True}
        assert backend.encode(value) == CeleryRedisBackend.encode(backend, value)
        assert backend._plain_json is False and backend._fast() is False
    context.uninstall()


def test_on_verified_versions_the_replacements_are_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "saferepr", saferepr)
    try:
        with verified_as_installed():
            context.install()
            resultrepr.install()
            assert Context._get_custom_headers is context.custom_headers  # type: ignore[attr-defined]
            assert trace.saferepr is resultrepr.result_repr  # type: ignore[attr-defined]
            assert serialization.decoder() is serialization.loads
    finally:
        context.uninstall()


def test_require_refuses_naming_the_library_and_both_versions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with unverified(monkeypatch, "kombu", "5.8.0"), pytest.raises(SystemExit) as refused:
        versions.require("API", compat.PRODUCER_LIBRARIES, allow_unverified=False)
    assert refused.value.code == versions.EX_REFUSED
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "kombu 5.8.0" in err and versions.verified()["kombu"] in err
    assert "make upgrade-check" in err and "ALLOW_UNVERIFIED_VERSIONS=true" in err


def test_require_lets_an_accepted_risk_start_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with unverified(monkeypatch, "redis", "9.0.0"), caplog.at_level(logging.WARNING, logger=versions.__name__):
        versions.require("beat", compat.BEAT_LIBRARIES, allow_unverified=True)
        versions.require("beat", compat.BEAT_LIBRARIES, allow_unverified=True)
    (record,) = [r for r in caplog.records if r.name == versions.__name__]
    assert "redis 9.0.0" in record.getMessage()


def test_the_installed_versions_are_the_verified_ones() -> None:
    """The lock installs what the seam was verified on (else every process here would refuse to start)."""
    assert versions.mismatches(versions.GUARDED) == []


def test_the_verified_ranges_are_the_project_s_declared_requirements() -> None:
    """One source: pyproject.toml's requirement on each guarded library is the range the guard accepts."""
    import tomllib

    declared = tomllib.loads(versions._PYPROJECT.read_text())["project"]["dependencies"]
    assert versions.verified() == versions.ranges(declared)
    for name, specifier in versions.verified().items():
        operators = {spec.operator for spec in SpecifierSet(specifier)}
        assert operators & {">=", ">"} and operators & {"<"}, f"{name}: {specifier} must be bounded on both sides"


def test_ranges_reads_each_guarded_library_from_requirements() -> None:
    found = versions.ranges(["celery[redis]>=5.7,<5.8", "redis>=8.1,<8.3", "types-redis>=4.6; extra == 'dev'"])
    assert found["celery"] == str(SpecifierSet(">=5.7,<5.8")) and found["redis"] == str(SpecifierSet(">=8.1,<8.3"))
    assert found["kombu"] == versions.UNDECLARED  # not named: no version of it is verified
    assert not versions._matches("5.7.0", versions.UNDECLARED)


@pytest.mark.parametrize(
    ("version", "accepted"),
    [("8.1.0", True), ("8.1.9", True), ("8.0.1", False), ("9.0.0", False), ("8.1.1rc1", True)],
)
def test_a_patch_release_inside_the_range_is_accepted_the_day_it_ships(
    monkeypatch: pytest.MonkeyPatch, version: str, accepted: bool
) -> None:
    monkeypatch.setitem(versions.verified(), "redis", ">=8.1,<8.2")
    with unverified(monkeypatch, "redis", version):
        assert (versions.mismatches(["redis"]) == []) is accepted


def test_libraries_follow_the_entries() -> None:
    assert compat.libraries("pipeline.compat.results") == ("celery", "kombu", "redis")
    assert compat.libraries("pipeline.compat.context") == ("celery",)
    assert compat.libraries("nowhere") == ()


def test_the_app_s_result_backends_are_this_package_s() -> None:
    """The configuration names them by string (`pipeline.config.celery.BACKENDS`), so it imports no module of here."""
    backends = {scheme: symbol_by_name(path) for scheme, path in BACKENDS.items()}
    assert backends == {
        "redis": RedisBackend,
        "rediss": RedisBackend,
        "sentinel": SentinelBackend,
        "rediscluster": ClusterBackend,
    }


@pytest.mark.parity
def test_a_task_pushed_on_another_thread_is_its_current_task_as_celerys_call_makes_it() -> None:
    """What `celery.current_task` answers inside Celery's own `Task.__call__` (which pushes the task) is what it answers
    on a fresh thread after `currenttask.push`; after `pop` it answers what it does outside Celery's call there."""
    import threading

    import celery

    from pipeline.compat import currenttask

    app = Celery("parity", set_as_current=False)
    seen: dict[str, Any] = {}

    @app.task(name="parity.current")
    def current_task() -> Any:
        return celery.current_task._get_current_object()

    current = app.tasks[current_task.name]

    def on_thread() -> None:
        seen["before"] = celery.current_task._get_current_object()
        seen["celery"] = current()  # Celery's own push, in this thread
        currenttask.push(current)
        try:
            seen["pushed"] = celery.current_task._get_current_object()
        finally:
            currenttask.pop()
        seen["after"] = celery.current_task._get_current_object()

    thread = threading.Thread(target=on_thread)
    thread.start()
    thread.join()
    assert seen["celery"] is current and seen["pushed"] is seen["celery"]
    assert seen["before"] is None and seen["after"] is None
