"""Flow lifecycle → metric observations, made by the worker that runs a flow's step jobs (`pipeline.flows.steps`) and
the one that dead-letters one (`pipeline.dlq.capture`).

Each is counted once, where Redis says it happened: a step job's `succeeded` in the call that recorded its result, a
flow's `succeeded` in the call that recorded its last node, a step's duration in the call that recorded its last job,
a flow's `failed` where a dead-letter made the flow's failed set non-empty. A flow's `started` is counted where its
first job (the first declared step's, a fan-out's item 0) begins its first run: a flow cancelled before any job of it
ran is never counted started. The labels are the flow's and step's declared names, never ids.
"""

from __future__ import annotations

from pipeline.observability import metrics


def step_started(flow: str, step: str, first_of_flow: bool) -> None:
    """A step's job begins its first run (`first_of_flow`: it is the flow's first job)."""
    metrics.child(metrics.flow_steps, flow, step, "started").inc()
    if first_of_flow:
        metrics.child(metrics.flows, flow, "started").inc()


def step_succeeded(flow: str, step: str, step_took: float | None, flow_finished: bool) -> None:
    """A step's job had its result recorded; `step_took`: the step's duration when that was its last job."""
    metrics.child(metrics.flow_steps, flow, step, "succeeded").inc()
    if step_took is not None:
        metrics.child(metrics.flow_step_duration, flow, step).observe(max(0.0, step_took))
    if flow_finished:
        metrics.child(metrics.flows, flow, "succeeded").inc()


def step_dead_lettered(flow: str, step: str, flow_failed: bool) -> None:
    """A step's job was dead-lettered (`flow_failed`: the flow turned failed with it)."""
    metrics.child(metrics.flow_steps, flow, step, "dead_lettered").inc()
    if flow_failed:
        metrics.child(metrics.flows, flow, "failed").inc()
