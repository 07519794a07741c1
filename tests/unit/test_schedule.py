"""The beat schedule built from settings: maintenance entries in UTC, user entries from BEAT_SCHEDULE."""

from __future__ import annotations

import json

import pytest
from celery.schedules import crontab, schedule

from pipeline.config import load_settings
from pipeline.config.celery import celery_conf
from pipeline.errors import ConfigError


def test_maintenance_entries_run_nightly_at_midnight_utc() -> None:
    conf = celery_conf(load_settings())
    assert conf["timezone"] == "UTC"
    assert conf["enable_utc"] is True
    assert conf["beat_scheduler"] == "pipeline.compat.redbeat:Scheduler"
    entries = conf["beat_schedule"]
    nightly = entries["pipeline.dlq-retention"]
    assert nightly["task"] == "pipeline.dlq_retention"
    assert nightly["schedule"] == crontab(minute="0", hour="0")
    purge = entries["pipeline.artifact-purge"]
    assert (purge["task"], purge["schedule"]) == ("pipeline.artifact_purge", crontab(minute="0", hour="0"))


def test_user_entries_come_from_the_beat_schedule_setting() -> None:
    raw = {
        "report": {"task": "pdf.render", "cron": "30 2 * * 1", "payload": {"a": 1}, "queue": "pdf"},
        "ping": {"task": "pipeline.probe", "every": 15},
    }
    settings = load_settings(beat_schedule=json.loads(json.dumps(raw)))
    entries = celery_conf(settings)["beat_schedule"]
    assert entries["report"]["schedule"] == crontab(minute="30", hour="2", day_of_week="1")
    assert entries["report"]["args"] == ({"a": 1},)
    assert entries["report"]["options"] == {"queue": "pdf"}
    assert entries["ping"]["schedule"] == schedule(15)
    assert "pipeline.dlq-retention" in entries


@pytest.mark.parametrize(
    "entry",
    [
        {"task": "x.y"},  # no timing
        {"task": "x.y", "cron": "* * * *"},  # four fields
        {"task": "x.y", "cron": "61 * * * *"},  # out of range
        {"task": "x.y", "cron": "* * * * *", "every": 5},  # both
    ],
)
def test_bad_user_entries_stop_the_process_with_the_setting_named(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="BEAT_SCHEDULE"):
        load_settings(beat_schedule={"bad": entry})


def test_beat_lease_must_outlast_two_ticks() -> None:
    with pytest.raises(ConfigError, match="BEAT_LOCK_TIMEOUT"):
        load_settings(beat_lock_timeout=5, beat_max_loop_interval=5)
    assert celery_conf(load_settings())["redbeat_lock_timeout"] <= 60
