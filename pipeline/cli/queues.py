"""`pipeline queues`: depth, oldest wait and state per queue, jobs in flight and Redis's memory; pause and resume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from pipeline.cli.output import emit_json, fail, refused
from pipeline.errors import BrokerWriteRefused

if TYPE_CHECKING:
    from pipeline.broker import MemoryStats, QueueStats

app = typer.Typer(help="Queue depths and states; pause and resume a queue.")
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
NameArg = Annotated[str, typer.Argument(metavar="NAME", help="A queue the app routes to (see `pipeline queues`).")]


@app.callback(invoke_without_command=True)
def show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Depth (all priorities, then per priority level), oldest waiting job and state (running or paused) per queue,
    jobs in flight, and Redis's memory against maxmemory. On a Redis Cluster also each queue's slot and the master
    serving it (the memory shown is the fullest master's)."""
    if ctx.invoked_subcommand is not None:
        return
    from pipeline.broker import memory_stats, queue_stats, unacked_count

    stats = queue_stats()
    in_flight = unacked_count()
    memory = memory_stats()
    where = _placements([s.name for s in stats])
    if as_json:
        queues = [{**s.__dict__, **where.get(s.name, {})} for s in stats]
        emit_json({"queues": queues, "in_flight": in_flight, "memory": _memory_json(memory)})
        return
    steps = list(stats[0].levels) if stats else []
    levels = " ".join(f"{'P' + str(step):>6}" for step in steps)
    slots = f"  {'SLOT':>5}  MASTER" if where else ""
    typer.echo(f"{'QUEUE':12} {'DEPTH':>7} {levels} {'OLDEST':>10}  {'STATE':7}{slots}".rstrip())
    for s in stats:
        age = f"{s.oldest_age_s:.1f}s" if s.oldest_age_s is not None else "-"
        per_level = " ".join(f"{s.levels.get(step, 0):>6}" for step in steps)
        at = f"  {where[s.name]['slot']:>5}  {where[s.name]['master']}" if where else ""
        typer.echo(f"{s.name:12} {s.depth:>7} {per_level} {age:>10}  {_state(s):7}{at}".rstrip())
    typer.echo("P0..P9: waiting per priority level (P0: priorities 0-2, taken first; P3: 3-5; P6: 6-8; P9: 9)")
    typer.echo(f"in flight (delivered, not yet acknowledged): {in_flight}")
    typer.echo(memory_line(memory))
    if memory.policy_warning:
        typer.secho(f"warning: {memory.policy_warning}", fg=typer.colors.YELLOW, err=True)


def _placements(queues: list[str]) -> dict[str, dict[str, Any]]:
    """On a Redis Cluster, each queue's slot (its hash tag's) and the master serving it now; else nothing."""
    from pipeline import cluster
    from pipeline.queues import keys

    if not keys.clustered():
        return {}
    client = cluster.shared()
    return {q: {"slot": p.slot, "master": p.master} for q in queues for p in [cluster.placement(client, q)]}


def _state(stats: QueueStats) -> str:
    from pipeline.constants import DEAD_LETTER_QUEUE

    if stats.name == DEAD_LETTER_QUEUE:
        return "-"  # no worker consumes it
    return "paused" if stats.paused else "running"


@app.command()
def pause(name: NameArg, as_json: JsonOpt = False) -> None:
    """Pause a queue: it keeps accepting jobs, no worker starts one until `resume`; running jobs finish."""
    _switch(name, paused=True, as_json=as_json)


@app.command()
def resume(name: NameArg, as_json: JsonOpt = False) -> None:
    """Resume a paused queue: idle workers start its jobs within a second."""
    _switch(name, paused=False, as_json=as_json)


def _switch(name: str, *, paused: bool, as_json: bool) -> None:
    """Pause or resume `name`: exit 2 for a name that is no queue the app routes to, 3 when the broker refused the
    write."""
    from pipeline.scheduling import pause as pausing

    try:
        changed = pausing.pause(name) if paused else pausing.resume(name)
    except (pausing.UnknownQueue, pausing.NotPausable) as exc:
        raise fail(str(exc), 2, as_json) from None
    except BrokerWriteRefused as exc:
        raise refused(exc, as_json) from None
    state = "paused" if paused else "running"
    if as_json:
        emit_json({"name": name, "paused": paused, "changed": changed})
    else:
        typer.echo(f"{name}: {state}" + ("" if changed else f" (it was {state} already)"))


def _memory_json(memory: MemoryStats) -> dict[str, Any]:
    return {
        "used_bytes": memory.used_bytes,
        "max_bytes": memory.max_bytes,
        "used_ratio": memory.used_ratio,
        "policy": memory.policy,
        "warning": memory.policy_warning,
    }


def memory_line(memory: MemoryStats) -> str:
    """`redis memory: 9.8 MiB of 12.0 MiB maxmemory (81.6 %), policy noeviction` (or `no maxmemory`)."""
    used = _size(memory.used_bytes)
    if not memory.max_bytes:
        return f"redis memory: {used} (no maxmemory set), policy {memory.policy}"
    return (
        f"redis memory: {used} of {_size(memory.max_bytes)} maxmemory ({memory.used_ratio:.1%}), policy {memory.policy}"
    )


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
