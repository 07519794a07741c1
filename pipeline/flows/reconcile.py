"""The reconciler of flows' hand-offs on a Redis Cluster: a step claimed and not queued is queued, once.

A hand-off (`pipeline.flows.handoff`) claims a step in the flow's slot, then enqueues its jobs on its queue. A process
killed between the two leaves the step claimed (`on:<step>` set, its nodes' job ids in the flow) and not queued; its
job, redelivered, finds its node recorded and claims nothing more. The flow is still on the hand-offs set
(`pipeline:flow-handoffs`): `reconcile` takes the flows whose latest hand-off began more than HANDOFF_GRACE_S ago
and, for a running flow, enqueues each claimed step whose nodes have no result, are not dead-lettered, and whose
idempotency key (`handoff.claim_key`, set by the enqueue itself, in the queue's slot) is absent: under that key and
with the job ids the claim named, so a hand-off finishing at the same time, or a second reconciler, writes nothing.
The step's payload is built again as the hand-off built it: from the flow's input and its parent's stored result (a
join's when it starts). Then the flow is taken off the set, unless a hand-off marked it again meanwhile.

The key is the proof that a step was queued (on a cluster a job's record is written before its enqueue, so a record
proves nothing); it lives ENQUEUE_IDEMPOTENCY_TTL, far longer than a flow waits on the set (a worker's or beat's
releaser loop calls `reconcile` every DELAYED_POLL_INTERVAL). A flow whose definition this process does not declare
stays on the set for a process that does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from pipeline.constants import FLOW_HANDOFFS_KEY
from pipeline.errors import PayloadInvalid
from pipeline.flows import handoff, launch, record
from pipeline.flows.definition import FLOWS, Flow, Step
from pipeline.flows.record import text
from pipeline.lua import script
from pipeline.producer.client import producer_redis

log = logging.getLogger(__name__)

#: How old a hand-off must be before the reconciler checks its flow (seconds): a live one is done long before.
HANDOFF_GRACE_S = 5.0


def reconcile(limit: int = 100, grace: float = HANDOFF_GRACE_S) -> int:
    """Check up to `limit` flows whose latest hand-off began more than `grace` seconds ago (see the module
    docstring); return how many steps it queued."""
    client = producer_redis()
    due: list[Any] = client.zrangebyscore(  # (member, score) pairs
        FLOW_HANDOFFS_KEY, "-inf", time.time() - grace, start=0, num=limit, withscores=True
    )
    queued = 0
    for member, score in due:
        flow_id = text(member)
        sent = _flow(client, flow_id)
        if sent is None:
            continue
        queued += sent
        script("flow_unmark")(keys=[FLOW_HANDOFFS_KEY], args=[flow_id, repr(score)], client=client)
    return queued


def _flow(client: redis.Redis, flow_id: str) -> int | None:
    """Queue flow `flow_id`'s claimed steps not queued yet; how many, or None when this process does not declare
    the flow (it stays on the set)."""
    fields = {text(k): text(v) for k, v in client.hgetall(record.key(flow_id)).items()}
    if not fields:
        return 0  # expired, or never created
    flow = FLOWS.get(fields.get("name", ""))
    if flow is None:
        return None
    if fields.get("state") != "running":
        return 0
    sent = 0
    for step in flow.steps.values():
        if f"on:{step.name}" in fields and _send(client, flow, flow_id, step, fields):
            sent += 1
    return sent


def _send(client: redis.Redis, flow: Flow[Any], flow_id: str, step: Step, fields: dict[str, str]) -> bool:
    """Enqueue claimed step `step` when nothing shows it was queued; True when this call queued it."""
    nodes = [f"{step.name}[{i}]" for i in range(int(fields[f"n:{step.name}"]))] if step.each else [step.name]
    pipe = client.pipeline(transaction=False)  # one slot: the flow's
    pipe.hmget(record.key(flow_id, ":results"), nodes)
    pipe.hmget(record.key(flow_id, ":tasks"), nodes)
    pipe.smismember(record.key(flow_id, ":failed"), nodes)
    results, tasks, failed = pipe.execute()
    if any(r is not None for r in results) or any(failed) or any(t is None for t in tasks):
        return False
    if client.exists(handoff.claim_key(flow_id, step)):
        return False
    try:
        offer = launch.queued(
            flow, flow_id, step, _given(client, flow, flow_id, step, fields), time.time(), [text(t) for t in tasks]
        )
    except (PayloadInvalid, ValueError) as exc:  # the mapping gave what it did not give the hand-off: not queued
        log.error("flow %s %s: step %s was claimed and cannot be built again: %s", flow.name, flow_id, step.name, exc)
        return False
    if not handoff.send(client, flow_id, offer):
        return False
    log.warning(
        "flow %s %s: step %s was claimed and not queued (its hand-off was cut short); queued it now",
        flow.name,
        flow_id,
        step.name,
    )
    return True


def _given(client: redis.Redis, flow: Flow[Any], flow_id: str, step: Step, fields: dict[str, str]) -> list[Any] | None:
    """The mapping's arguments of `step` as its hand-off gave them: the flow's input and its parent's result; None
    for a join (its payload is built when it starts)."""
    if flow.joins(step):
        return None
    given: list[Any] = [flow.input_model.model_validate_json(fields["input"])]
    for parent in step.after:  # a step built at hand-off has at most one parent, not a fan-out
        stored = client.hget(record.key(flow_id, ":results"), parent)
        given.append(flow.steps[parent].task.result_model.model_validate_json(stored or b""))
    return given
