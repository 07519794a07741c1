"""The Celery application: settings applied, task modules named by string, signal handlers installed.

`celery -A pipeline worker|beat|flower|inspect` finds `app` through `pipeline/__init__.py`.
"""

from __future__ import annotations

from celery import Celery

from pipeline import flower_auth, signals
from pipeline.config import celery_conf, get_settings
from pipeline.constants import TASK_MODULES


def create_app() -> Celery:
    settings = get_settings()
    celery = Celery("pipeline", include=list(TASK_MODULES))
    celery.conf.update(celery_conf(settings))
    signals.install()
    flower_auth.install()
    return celery


app = create_app()
