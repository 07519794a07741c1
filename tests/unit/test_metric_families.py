"""The worker switches prometheus-client to multiprocess mode after `metrics` is imported
(`pipeline.observability.multiproc`): safe only while no family holds a value, i.e. every family has labels."""

from __future__ import annotations

import os

from prometheus_client.metrics import MetricWrapperBase

from pipeline.observability import metrics


def test_every_family_is_listed_and_labelled() -> None:
    declared = {name for name, obj in vars(metrics).items() if isinstance(obj, MetricWrapperBase)}
    listed = {name for name, obj in vars(metrics).items() if any(obj is family for family in metrics.FAMILIES)}
    assert declared == listed
    unlabelled = [family._name for family in metrics.FAMILIES if not family._labelnames]
    assert unlabelled == [], "an unlabelled family holds a value from import on: it could not switch modes"


def test_no_directory_is_made_without_metrics_port() -> None:
    from prometheus_client import values

    from pipeline.config import get_settings
    from pipeline.observability import multiproc

    assert get_settings().metrics_port is None
    before = values.ValueClass
    assert multiproc.prepare("unit@host") is None
    assert multiproc.directory() is None
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert values.ValueClass is before
