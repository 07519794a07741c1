"""pytest plugin for Celery's integration suite: a throwaway Redis and one external worker per pytest process.

Loaded with `-p tests.celery_suite.plugin` (see `suite.ini`) into a run of the sdist's `t/integration`. Before the
suite's conftest is imported (it reads TEST_BROKER at import) each pytest process (each xdist worker, not the
controller) starts its own redis-server and the worker the variant names, `celery -A <CELERY_SUITE_APP> worker
-P <CELERY_SUITE_POOL> -c 1` named as the suite expects its session worker (`anon_nodename()` of this process), and
stops both by PID when it ends. The suite's in-process session worker is replaced by that external worker: Celery's
own `NO_WORKER` switch cannot be used, its fixture then yields nothing, which pytest refuses.

Tests listed in `expected.txt` for this variant run as strict xfails; every test's time is capped
(CELERY_SUITE_TEST_TIMEOUT, pytest-timeout), Celery's own longer `timeout` marks included.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import celery.contrib.pytest
import pytest

from tests.support.procs import Command, RedisServer, wait_for

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected.txt"
VARIANT = os.environ.get("CELERY_SUITE_VARIANT", "stock-prefork")
_started: list[RedisServer | Command] = []


def _is_xdist_controller() -> bool:
    """The runner says when xdist is on (CELERY_SUITE_XDIST); xdist names its workers before they configure."""
    return bool(os.environ.get("CELERY_SUITE_XDIST")) and not os.environ.get("PYTEST_XDIST_WORKER")


def worker_env(redis_url: str, base: Path) -> dict[str, str]:
    """The external worker's environment: the suite's URLs for the stock app, settings for the pipeline's."""
    from tests.conftest import TEST_ENV  # the settings every pipeline worker of the test suite runs with

    env = {**TEST_ENV, "REDIS_URL": redis_url, "DATA_DIR": str(base / "data"), "MEDIA_ROOT": str(base / "media")}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    if os.environ.get("CELERY_SUITE_POOL") == "custom":
        env["CELERY_CUSTOM_WORKER_POOL"] = "pipeline.runtime.asyncpool:AsyncPool"
    return env


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Start Redis and the worker before the suite's conftest is imported (it reads TEST_BROKER at import)."""
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated run still stops what it started (pytest_unconfigure)
    if _is_xdist_controller():
        return
    base = Path(tempfile.mkdtemp(prefix=f"celery-suite-{VARIANT}-"))
    server = RedisServer(base / "redis").start()
    _started.append(server)
    _record(server.proc)
    broker = f"redis://127.0.0.1:{server.port}/0"
    backend = f"redis://127.0.0.1:{server.port}/{os.environ.get('CELERY_SUITE_RESULT_DB', '0')}"
    # Read by the suite's conftest at import and by its tasks module (`get_redis_connection`), here and in the worker.
    os.environ.update(TEST_BROKER=broker, TEST_BACKEND=backend, REDIS_HOST="127.0.0.1", REDIS_PORT=str(server.port))
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("CELERY_RESULT_BACKEND", None)
    env = worker_env(broker, base)
    if backend != broker:
        env["RESULT_BACKEND_URL"] = backend
    node = f"gen{os.getpid()}@{socket.gethostname()}"  # celery.utils.nodenames.anon_nodename(): what tests ask for
    argv = [sys.executable, "-m", "celery", "-A", os.environ.get("CELERY_SUITE_APP", "tests.celery_suite.stock_worker")]
    argv += ["worker", "-n", node, "-P", os.environ.get("CELERY_SUITE_POOL", "prefork"), "-c", "1", "-Q", "celery"]
    argv += ["-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    worker = Command(argv, base / "worker.log", env).start()
    _started.append(worker)
    _record(worker.proc)
    wait_for(lambda: " ready." in worker.log() or not worker.running(), 120, 0.1, what="the external worker")
    if not worker.running():
        pytest_unconfigure(early_config)  # pytest does not unconfigure a run that failed to start
        raise pytest.UsageError(f"the external worker exited at start:\n{worker.log()[-4000:]}")
    _log.append(worker.log_path)


_log: list[Path] = []


def _record(proc: subprocess.Popen[bytes] | None) -> None:
    """Note a started process group's PID in CELERY_SUITE_PIDS: the runner stops whatever is left of it."""
    if proc is not None and os.environ.get("CELERY_SUITE_PIDS"):
        with open(os.environ["CELERY_SUITE_PIDS"], "a") as pids:
            pids.write(f"{proc.pid}\n")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def pytest_unconfigure(config: pytest.Config) -> None:
    while _started:
        _started.pop().stop()


@pytest.fixture(scope="session")
def celery_session_worker(celery_session_app: Any, celery_includes: Any, celery_class_tasks: Any) -> Path:
    """What Celery's fixture does besides starting a worker (the tasks registered on the test app), then the
    external worker's log path in its place."""
    for module in celery_includes:
        celery_session_app.loader.import_task_module(module)
    for class_task in celery_class_tasks:
        celery_session_app.register_task(class_task)
    return _log[0]


# The suite's conftest imports this name from `celery.contrib.pytest`: it gets the fixture above.
celery.contrib.pytest.celery_session_worker = celery_session_worker  # type: ignore[attr-defined]


#: How an entry of `expected.txt` runs, by the first word of its cause: not at all (it fails for the harness's sake, or
#: its failing subtests would fail the run whatever the xfail), as a non-strict xfail (it fails some runs), else strict.
NOT_RUN = ("external", "harness:", "subtests:")
NOT_STRICT = ("flaky:",)


def expected_failures(variant: str) -> dict[str, str]:
    """`expected.txt`'s entries for `variant`: test id (relative to t/integration) → cause."""
    entries: dict[str, str] = {}
    for line in EXPECTED.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        patterns, test, cause = (part.strip() for part in line.split("|", 2))
        if any(fnmatch.fnmatchcase(variant, pattern) for pattern in patterns.split(",")):
            entries[test] = cause
    return entries


def xfail(cause: str) -> pytest.MarkDecorator:
    run, strict = not cause.startswith(NOT_RUN), not cause.startswith(NOT_STRICT)
    return pytest.mark.xfail(reason=f"expected.txt: {cause}", run=run, strict=strict)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expected = expected_failures(VARIANT)
    cap = float(os.environ.get("CELERY_SUITE_TEST_TIMEOUT", "60"))
    for item in items:
        marker = item.get_closest_marker("timeout")
        given = marker.kwargs.get("timeout", marker.args[0] if marker.args else cap) if marker else cap
        item.add_marker(pytest.mark.timeout(min(float(given), cap)), append=False)
        test = item.nodeid.split("t/integration/", 1)[-1]
        if test in expected:
            item.add_marker(xfail(expected.pop(test)))
    selected = {item.nodeid.split("t/integration/", 1)[-1].split("::")[0] for item in items}
    stale = [test for test in expected if test.split("::")[0] in selected]
    if stale and not config.getoption("-k") and not config.getoption("-m"):
        config.stash[_STALE] = stale


_STALE = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    stale = config.stash.get(_STALE, [])
    if stale:
        terminalreporter.section(f"expected.txt entries for {VARIANT} that match no collected test")
        for test in stale:
            terminalreporter.write_line(test)
