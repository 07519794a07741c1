"""The worker switches prometheus-client to multiprocess mode after `metrics` is imported
(`pipeline.observability.multiproc`): safe only while no family holds a value, i.e. every family has labels."""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase

from pipeline.observability import metrics


def test_every_family_is_listed_and_labelled() -> None:
    declared = {name for name, obj in vars(metrics).items() if isinstance(obj, MetricWrapperBase)}
    listed = {name for name, obj in vars(metrics).items() if any(obj is family for family in metrics.FAMILIES)}
    assert declared == listed
    unlabelled = [family._name for family in metrics.FAMILIES if not family._labelnames]
    assert unlabelled == [], "an unlabelled family holds a value from import on: it could not switch modes"
