"""The Celery application, built from `Settings` on first use and never at import.

`get_app()` is what producers (CLI, API, your code) and the rest of the pipeline use. The worker, beat and
Flower reach the same object through `celery -A pipeline`, where `pipeline.app` also installs the worker's
runtime (signal handlers, Flower's auth: `pipeline.runtime`). Task modules are named by string
(`TASK_MODULES`) and their typed tasks attach themselves when the app is finalized (Celery's shared tasks),
so importing a task module builds nothing.
"""

from __future__ import annotations

import threading

from celery import Celery

from pipeline.config import get_settings
from pipeline.config.celery import BACKENDS, celery_conf
from pipeline.constants import TASK_MODULES

_lock = threading.Lock()
_app: list[Celery] = []


def get_app() -> Celery:
    """The process's configured Celery app (settings read and validated on the first call)."""
    if _app:
        return _app[0]
    with _lock:
        if not _app:
            settings = get_settings()  # raises ConfigError (a SystemExit naming the variable) when invalid
            app = Celery("pipeline", include=list(TASK_MODULES), set_as_current=True)
            # Celery's Redis result backends, storing a state in one round trip (`pipeline.compat.results`).
            app.loader.override_backends = dict(BACKENDS)
            app.conf.update(celery_conf(settings))
            _app.append(app)
    return _app[0]
