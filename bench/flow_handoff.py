"""What a flow's hand-off costs on one Redis: the one atomic `flow_advance.lua` call against the split hand-off a
Redis Cluster needs (`pipeline.flows.handoff`: the hand-offs set, the flow's own call, then the step's enqueue).

    REDIS_URL=redis://127.0.0.1:6379/0 python -m bench.flow_handoff [REPS] [N]     (a Redis it may fill)

Per rep, N two-step flows are started, then the first step of each is handed off (its result recorded, the second
step queued) by one path, then N more by the other; the paths alternate. Measured around the hand-offs only: the
wall time per hand-off in this process, Redis's CPU per hand-off (INFO commandstats: every command's usec, a
script's own commands included) and its commands. The reconciler's later check of each split hand-off (4 more round
trips, in the background) is not counted. Medians of the reps. Not a test: nothing is asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import redis
from pydantic import BaseModel

from bench.pipeline_app import NoopJob, NoopResult, app, noop
from pipeline.flows import Flow, handoff, launch
from pipeline.flows.record import Ref
from pipeline.producer.client import producer_redis

__all__ = ["app", "chain"]

FLOWS = 500


class ChainOrder(BaseModel):
    run: str


chain = Flow("bench_chain", ChainOrder)


@chain.step("first", noop)
def first(order: ChainOrder) -> NoopJob:
    return NoopJob(run=order.run)


@chain.step("second", noop, after=["first"])
def second(order: ChainOrder, first: NoopResult) -> NoopJob:
    return NoopJob(run=f"{order.run}-second")


def _spent(client: redis.Redis) -> tuple[int, int]:
    """(usec, calls) of every command Redis ran so far."""
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(v["usec"]) for v in stats.values()), sum(int(v["calls"]) for v in stats.values())


def _phase(plain: redis.Redis, split: bool, n: int) -> dict[str, float]:
    client = producer_redis()
    order = ChainOrder(run=uuid.uuid4().hex[:12])
    text = order.model_dump_json()
    result = NoopResult().model_dump(mode="json")
    ready = []
    for _ in range(n):
        flow_id = launch.start(chain, order)
        ref = Ref(chain.name, flow_id, "first")
        offers = launch._offers(chain, ref, chain.steps["first"], result, text)
        ready.append((flow_id, launch._head(chain, ref, str(uuid.uuid4()), result), offers))
    usec, calls = _spent(plain)
    began = time.perf_counter()
    for flow_id, head, offers in ready:
        if split:
            handoff.advance(client, flow_id, head, [], offers)
        else:
            launch._call(client, flow_id, head, [], offers)
    took = time.perf_counter() - began
    usec_after, calls_after = _spent(plain)
    return {
        "wall_us": 1e6 * took / n,
        "redis_cpu_us": (usec_after - usec) / n,
        "commands": (calls_after - calls - 1) / n,  # less the INFO between the two reads
    }


def main(reps: int = 3, n: int = FLOWS) -> dict[str, Any]:
    plain = redis.Redis.from_url(os.environ["REDIS_URL"])
    runs: dict[str, list[dict[str, float]]] = {"atomic": [], "split": []}
    for rep in range(reps):
        for kind in ("atomic", "split") if rep % 2 == 0 else ("split", "atomic"):
            runs[kind].append(_phase(plain, kind == "split", n))
    medians = {kind: {k: statistics.median(r[k] for r in found) for k in found[0]} for kind, found in runs.items()}
    print(f"flow_handoff: {n} chain-step hand-offs per path and rep, one Redis, medians of {reps}")
    for kind, m in medians.items():
        print(
            f"  {kind:7} {m['wall_us']:8,.0f} us a hand-off, Redis CPU {m['redis_cpu_us']:6,.1f} us, "
            f"{m['commands']:.1f} commands"
        )
    result = {"flows": n, "reps": reps, **medians, "all": runs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
