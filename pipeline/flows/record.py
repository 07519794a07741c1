"""A flow's state in Redis: its keys, its nodes, and the calls that change it.

The layout (one hash tag per flow: its id) is written at the top of `pipeline/lua/flow_advance.lua`, the script that
creates a flow and records each node's result exactly once, queueing the steps that waited on it last.
`flow_begin.lua` is what a step's job reads as it starts, `flow_cancel.lua` ends a running flow. `failed` and
`replaced` keep the set of dead-lettered nodes: a node there makes the flow `failed`, until its replay.

A node is one job of a flow: a step's name, or `<step>[<i>]` for item i of a fan-out step. Each step's message carries
`Ref.header()` (HEADER_FLOW), so a worker, the dead-letter queue and a replay know which node a job runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.broker import broker_redis, check_replicas, run_script_waited
from pipeline.config import get_settings
from pipeline.constants import FLOW_KEY
from pipeline.lua import script

_NODE = re.compile(r"^([a-z][a-z0-9_]*)(?:\[(\d+)\])?$")


@dataclass(frozen=True)
class Ref:
    """Which node of which flow a job runs: what its HEADER_FLOW says."""

    flow: str
    id: str
    step: str
    item: int | None = None

    @property
    def node(self) -> str:
        return self.step if self.item is None else f"{self.step}[{self.item}]"

    def header(self) -> dict[str, Any]:
        return {"flow": self.flow, "id": self.id, "step": self.step, "item": self.item}

    @classmethod
    def of(cls, header: Any) -> Ref | None:
        """The reference a message header holds; None for anything else (a foreign client's value)."""
        if not isinstance(header, dict):
            return None
        flow, fid, step, item = (header.get(k) for k in ("flow", "id", "step", "item"))
        if not (isinstance(flow, str) and isinstance(fid, str) and isinstance(step, str)):
            return None
        if item is not None and not (isinstance(item, int) and item >= 0):
            return None
        return cls(flow, fid, step, item)


def parse_node(node: str) -> tuple[str, int | None]:
    """(step, item) of a node name."""
    match = _NODE.match(node)
    if match is None:
        raise ValueError(f"not a node name: {node!r}")
    return match[1], int(match[2]) if match[2] is not None else None


def key(flow_id: str, suffix: str = "") -> str:
    """The flow's key (`suffix` '' for its hash, ':results', ':tasks', ':failed', ':wait:<step>')."""
    return FLOW_KEY.format(id=flow_id) + suffix


def ttl() -> int:
    """How long a flow's keys (and its jobs' records) live after its last change: RESULT_EXPIRES."""
    return get_settings().result_expires


@dataclass(frozen=True)
class Advanced:
    """What `flow_advance.lua` answered."""

    #: This call recorded the node (or created the flow); False: recorded before, or no such flow.
    recorded: bool
    #: The flow's state ('' for no such flow).
    state: str
    #: The node's step has all its nodes recorded.
    complete: bool
    queued: list[str]
    #: When the node's step was queued (epoch s), if this call recorded its last node (the step is done here).
    since: float | None = None
    #: Creating with an idempotency key an earlier start claimed: that flow's id (nothing was written).
    first: str | None = None
    #: The job's result given to store (`JobResult`): 1 stored, 0 a final state was there, -1 fenced; None: none
    #: given, or no such flow (nothing stored).
    stored: int | None = None

    @property
    def finished(self) -> bool:
        """This call recorded the flow's last node: the flow succeeded here (a flow succeeds in the call that records
        the last of its nodes, and a node is recorded once)."""
        return self.recorded and self.state == "succeeded"


def advance(client: redis.Redis, flow_id: str, keys: Sequence[str], args: Sequence[Any]) -> Advanced:
    """Run `flow_advance.lua` (KEYS after the flow's hash, ARGV as documented there), confirmed by
    REDIS_WAIT_REPLICAS replicas (`NotReplicated` otherwise)."""
    reply, reached = run_script_waited(client, "flow_advance", [key(flow_id), *keys], list(args))
    if reached is not None:
        check_replicas(reached)
    recorded, state, complete, since, first, stored, *queued = reply
    return Advanced(
        bool(recorded),
        text(state),
        bool(complete),
        [text(q) for q in queued],
        since=float(since) if since else None,
        first=text(first) if first else None,
        stored=int(stored) if stored not in (b"", "") else None,
    )


@dataclass(frozen=True)
class JobResult:
    """A step's job's SUCCESS as its result backend stores it (`OneTripStore.success_to_store`), for the call that
    records the node to store too: the task's key, the encoded meta, its expiry in seconds (0: none), and the job's
    delivery tag and lease owner (both '' when it was not a leased delivery: stored unfenced)."""

    key: str
    meta: str
    expires: int
    tag: str
    owner: str


@dataclass(frozen=True)
class Carried:
    """A fan-out item's node, handed to the call that carries its job's result and acknowledgement (a solo worker's
    next fetch: `pipeline.delivery.acks`) to record, as `flow_advance.lua` records an item offering no step."""

    flow_id: str
    node: str
    step: str
    #: The node's result (JSON).
    result: str
    job_id: str
    #: When the job finished (epoch s): the flow's `finished`, if the record finishes it.
    at: float
    #: Called on the worker's event loop with what the record answered, before the job is acknowledged: it queues
    #: what the node's complete step lets run. When it raises, or no answer came, the job is not acknowledged here
    #: (it is delivered again, and finds its node recorded or not).
    answered: Callable[[Advanced], None]
    #: Records the node by a call of its own (`flow_advance.lua`), when no fetch is about to carry it.
    record_now: Callable[[], Advanced]

    def key(self) -> str:
        return key(self.flow_id)

    def args(self) -> list[Any]:
        """The node's fields in `fetch.lua`'s ARGV."""
        return [self.node, self.result, self.job_id, self.step, repr(self.at), ttl()]

    @staticmethod
    def answer(fields: Sequence[Any]) -> Advanced:
        """A record's answer (`fetch.lua`: 4 fields per node) as `flow_advance.lua`'s."""
        recorded, state, complete, since = fields
        return Advanced(bool(recorded), text(state), bool(complete), [], since=float(since) if since else None)


#: Takes a fan-out item's node (`Carried`) for the call that will acknowledge the job `request` runs, to record it
#: there; True when it did. A solo worker's delivery layer installs one (`pipeline.delivery.acks`).
CARRIERS: list[Callable[[Carried, Any], bool]] = []


@dataclass(frozen=True)
class Begun:
    """What a step's job learns as it starts (`begin`)."""

    state: str | None
    #: The node's result, when it was recorded before (a redelivered or replayed job that had finished).
    result: str | None
    input: str | None
    #: Per parent step asked for: its result, or a fan-out's items' results in order (None for one not recorded).
    parents: dict[str, str | list[str | None] | None]


def begin(client: redis.Redis, ref: Ref, task_id: str, want_input: bool, parents: Sequence[str]) -> Begun:
    """Run `flow_begin.lua` for node `ref` starting as job `task_id`."""
    reply = script("flow_begin")(
        keys=[key(ref.id)], args=[ref.node, task_id, "1" if want_input else "", *parents], client=client
    )
    state = reply[0] if reply else None
    if state is None or len(reply) < 3:
        return Begun(text(state) if state is not None else None, None, None, {})
    out: dict[str, str | list[str | None] | None] = {}
    at = 3
    for parent in parents:
        count = int(reply[at])
        if count < 0:
            out[parent] = _maybe(reply[at + 1])
            at += 2
        else:
            out[parent] = [_maybe(v) for v in reply[at + 1 : at + 1 + count]]
            at += 1 + count
    return Begun(text(state), _maybe(reply[1]), _maybe(reply[2]), out)


def failed(ref: Ref) -> bool:
    """Node `ref`'s job was dead-lettered: the flow is failed at its step until the node's job is replayed. True when
    the flow turned failed with it (no other node of it was failed)."""
    with broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        pipe.sadd(key(ref.id, ":failed"), ref.node)
        pipe.scard(key(ref.id, ":failed"))
        pipe.expire(key(ref.id, ":failed"), ttl())
        added, count, _ = pipe.execute()
    return bool(added) and count == 1


def replaced(ref: Ref, task_id: str) -> None:
    """Node `ref`'s dead-lettered job was replayed as job `task_id`: the flow runs on (it is not failed there)."""
    with broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        pipe.srem(key(ref.id, ":failed"), ref.node)
        pipe.hset(key(ref.id, ":tasks"), ref.node, task_id)
        pipe.execute()


def cancel(client: redis.Redis, flow_id: str) -> str | None:
    """Run `flow_cancel.lua`: the state the flow had (only a running one is now cancelled), None if there is none."""
    before = script("flow_cancel")(keys=[key(flow_id)], args=[repr(time.time())], client=client)
    return text(before) if before is not None else None


def text(value: Any) -> str:
    """A Redis reply (bytes or str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(value: Any) -> str | None:
    return None if value is None else text(value)
