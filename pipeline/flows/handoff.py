"""A flow's hand-off on a Redis Cluster: the flow's own call, then each claimed step enqueued on its queue.

On a single Redis one `flow_advance.lua` call records a node and queues the steps it lets run. On a cluster a step's
queue lives in its own slot (`{<queue>}`), maybe on another master than the flow's (`{<flow id>}`), and no script
spans two slots. So the hand-off is split:

1. the flow goes on the hand-offs set (`pipeline:flow-handoffs`, a single key) before its call, when the call may
   claim a step;
2. `flow_claim.lua`, in the flow's slot, creates the flow or records the node, and claims each step that may be
   queued now (its `on:` field, set once) with its nodes' job ids;
3. each claimed step's jobs are enqueued on its queue (`pipeline.producer.script.store_jobs`, one call in the queue's
   slot) under an idempotency key named by the flow id and the step (`claim_key`): whoever enqueues a step again,
   with the same job ids, writes nothing.

A process killed between 2. and 3. leaves a step claimed and not queued, and the flow on the hand-offs set: the
reconciler (`pipeline.flows.reconcile`) queues such a step once the hand-off is older than HANDOFF_GRACE_S, and takes
the flow off the set. The flows index and the start's idempotency key are single keys written here; a step's job's
result is stored by the result backend on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.broker import check_replicas, run_script_waited
from pipeline.config import get_settings
from pipeline.constants import FLOW_HANDOFFS_KEY, FLOWS_INDEX_KEY
from pipeline.flows import record
from pipeline.flows.definition import Step
from pipeline.flows.record import Advanced, text
from pipeline.producer.script import store_jobs
from pipeline.queues import keys as layout
from pipeline.queues import wake

#: Called with the flow id and the steps its call claimed, after that call and before their enqueue: the point a
#: fault test stops a worker at (a step claimed and not queued, left to the reconciler).
CLAIMED: list[Callable[[str, list[str]], None]] = []


@dataclass
class Queued:
    """One step's jobs, offered to the flow's call: queued (or, on a cluster, claimed) when the step has nothing left
    to wait on."""

    step: Step
    nodes: list[str]
    ids: list[str]
    messages: list[str]
    dest: str
    record: str
    channel: str
    events: list[str]

    def redis_keys(self) -> list[str]:
        """Its queue's keys in `flow_advance.lua`'s KEYS (a single Redis)."""
        queue = self.step.task.queue
        return [self.dest, wake.marker(self.dest), layout.recent(queue)]

    def args(self) -> list[Any]:
        """Its fields in `flow_advance.lua`'s ARGV."""
        head = [self.step.name, len(self.nodes), "1" if self.step.each else "", self.record, self.channel]
        return [*head, *self.nodes, *self.ids, *self.messages, *self.events]

    def claim_args(self) -> list[Any]:
        """Its fields in `flow_claim.lua`'s ARGV."""
        return [self.step.name, len(self.nodes), "1" if self.step.each else "", *self.nodes, *self.ids]


def claim_key(flow_id: str, step: Step) -> str:
    """The idempotency key under which step `step` of flow `flow_id` is enqueued, in the step's queue's slot."""
    return layout.idempotency(step.task.queue, step.task.name, f"flow:{flow_id}:{step.name}")


def advance(client: redis.Redis, flow_id: str, head: list[Any], pairs: list[str], offers: list[Queued]) -> Advanced:
    """One hand-off (see the module docstring): `head` is `flow_advance.lua`'s ARGV 1-3 and 8-12, `pairs` and
    `offers` as there. The steps the call claimed are enqueued before it returns."""
    now = time.time()
    if offers:
        client.zadd(FLOW_HANDOFFS_KEY, {flow_id: now})
    args = [*head[:3], repr(now), record.ttl(), head[3], head[4], *head[5:8], len(pairs) // 2, len(offers), *pairs]
    args += [a for q in offers for a in q.claim_args()]
    reply, reached = run_script_waited(client, "flow_claim", [record.key(flow_id)], args)
    if reached is not None:
        check_replicas(reached)
    recorded, state, complete, since, *claimed = reply
    done = Advanced(
        bool(recorded),
        text(state),
        bool(complete),
        [text(c) for c in claimed],
        since=float(since) if since else None,
    )
    for hook in CLAIMED:
        hook(flow_id, done.queued)
    for offer in offers:
        if offer.step.name in done.queued:
            send(client, flow_id, offer)
    return done


def start(
    client: redis.Redis, holder: str | None, head: list[Any], pairs: list[str], offers: list[Queued], now: float
) -> str:
    """Create the flow `head` names and enqueue its first steps; return its id. `holder`: the Redis key of the
    start's idempotency key, claimed first (a single key): when an earlier start holds it, that start's flow is
    created under its id if it is not there yet (that start died between its claim and its call), else nothing is
    written and its id is returned."""
    flow_id = str(head[5])
    if holder is not None and not client.set(holder, flow_id, nx=True, ex=get_settings().enqueue_idempotency_ttl):
        first = client.get(holder)
        if first is not None:
            flow_id = text(first)
            if client.exists(record.key(flow_id)):
                return flow_id
    created = advance(client, flow_id, [*head[:5], flow_id, *head[6:]], pairs, offers)
    if created.recorded:
        pipe = client.pipeline(transaction=False)
        pipe.zadd(FLOWS_INDEX_KEY, {flow_id: now})
        pipe.zremrangebyrank(FLOWS_INDEX_KEY, 0, -get_settings().recent_jobs_max - 1)
        pipe.execute()
    return flow_id


def send(client: redis.Redis, flow_id: str, offer: Queued) -> bool:
    """Enqueue a claimed step's jobs on its queue under its idempotency key; False when they were enqueued before
    (nothing written)."""
    step = offer.step
    existing = store_jobs(
        client,
        queue=step.task.queue,
        dest=offer.dest,
        record=offer.record,
        record_ttl=record.ttl(),
        now=time.time(),
        ids=offer.ids,
        messages=offer.messages,
        channel=offer.channel,
        events=offer.events,
        claim=(claim_key(flow_id, step), get_settings().enqueue_idempotency_ttl),
    )
    return existing is None
