"""`pipeline flow`: the declared flows; start one, follow it step by step, list recent flows, cancel one.

Exit codes as the job commands: 2 for bad input, an unknown flow or an unknown id; 3 when the broker refused the
write (or is unreachable); 1 when a followed flow did not succeed, or a cancelled one had finished already.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pipeline.cli.output import emit_json, exits, fail, read_payload

if TYPE_CHECKING:
    from pipeline.control.flows import FlowStatus
    from pipeline.flows import Flow

app = typer.Typer(help="Multi-step flows: start one, follow its steps, list and cancel flows.", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
IdArg = Annotated[str, typer.Argument(metavar="ID", help="The flow's id (`flow start` printed it).")]
BAR = 20


def _declared(name: str, as_json: bool) -> Flow[Any]:
    """The declared flow `name` (exit 2 naming the declared ones if there is none)."""
    from pipeline.flows import FlowNotFound, get_flow
    from pipeline.task import load_task_modules

    load_task_modules()  # the modules that declare the flows
    try:
        return get_flow(name)
    except FlowNotFound as exc:
        raise fail(str(exc), 2, as_json) from None


def bar(percent: float) -> str:
    filled = round(BAR * max(0.0, min(percent, 100.0)) / 100)
    return "[" + "#" * filled + "-" * (BAR - filled) + "]"


def _time(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def status_lines(status: FlowStatus) -> list[str]:
    """A flow for a person: its state and progress, then one line per step (state, jobs done/total, progress)."""
    failed = f" at step {status.failed_step}" if status.failed_step else ""
    lines = [
        f"flow {status.flow} {status.id}",
        f"state:    {status.state}{failed}  {bar(status.progress)} {status.progress:5.1f} %",
        f"started:  {_time(status.created_at)} UTC   finished: {_time(status.finished_at)}",
        "",
        f"{'STEP':16} {'STATE':26} {'JOBS':>11}  PROGRESS",
    ]
    for step in status.steps:
        if step.state is None:
            state, jobs, progress = f"waiting for {', '.join(step.waiting_for)}", "-", ""
        else:
            state, jobs = str(step.state), f"{step.counts.get('succeeded', 0)}/{step.jobs}"
            progress = f"{bar(step.progress)} {step.progress:5.1f} %"
        name = step.name + (" (each)" if step.fan_out else "")
        lines.append(f"{name:16} {state:26} {jobs:>11}  {progress}".rstrip())
    dead = [job.id for step in status.steps for job in step.items if job.state == "dead_lettered"]
    if dead and status.state == "failed":
        lines += ["", "to continue it from the failed step: " + "; ".join(f"pipeline dlq replay {i}" for i in dead[:3])]
    return lines


def follow(flow_id: str, timeout: float, show: bool) -> FlowStatus:
    """Poll the flow until it is final (or `timeout` passed: then it is returned not final), redrawn in place."""
    from rich.live import Live
    from rich.text import Text

    from pipeline.control.flows import flow_status

    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        live = stack.enter_context(Live(Text(""), auto_refresh=False, transient=True)) if show else None
        while True:
            status = flow_status(flow_id)
            if live is not None:
                live.update(Text("\n".join(status_lines(status))), refresh=True)
            if status.final or time.monotonic() > deadline:
                return status
            time.sleep(0.5)


def _finish(status: FlowStatus, as_json: bool, timeout: float) -> None:
    """Print a followed flow's last status; exit 1 unless it succeeded."""
    emit_json(status.model_dump(mode="json")) if as_json else typer.echo("\n".join(status_lines(status)))
    if not status.final:
        raise fail(f"timeout: still {status.state} after {timeout}s", 1)
    if status.state != "succeeded":
        raise typer.Exit(1)


@app.command("kinds")
def kinds(as_json: JsonOpt = False) -> None:
    """The declared flows: their steps (task, fan-out, the steps each runs after), and what each does."""
    from pipeline.flows import FLOWS
    from pipeline.task import load_task_modules

    load_task_modules()
    flows = sorted(FLOWS.values(), key=lambda f: f.name)
    if as_json:
        emit_json([{"name": f.name, "description": f.description, "steps": _steps(f)} for f in flows])
        return
    for f in flows:
        typer.echo(f"{f.name:12} {f.outline()}" + (f"\n{'':12} {f.description}" if f.description else ""))


def _steps(flow: Flow[Any]) -> list[dict[str, Any]]:
    return [
        {"name": s.name, "task": s.task.name, "after": list(s.after), "fan_out": s.each} for s in flow.steps.values()
    ]


@app.command("start")
def start(
    name: Annotated[str, typer.Argument(metavar="NAME", help="A declared flow (see `pipeline flow kinds`).")],
    input_json: Annotated[str | None, typer.Argument(metavar="[INPUT]", help="JSON object, @file, or -.")] = None,
    input_file: Annotated[str | None, typer.Option(help="Read the input from this JSON file.")] = None,
    example: Annotated[bool, typer.Option("--example", help="Start it with the flow's example input.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Same key → the first flow's id, not a second flow (ENQUEUE_IDEMPOTENCY_TTL).")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow it to its end, step by step.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after this many seconds.")] = 3600,
    as_json: JsonOpt = False,
) -> None:
    """Validate the input and start the flow (its first steps' jobs are published); print its id.

    With --wait, follow it until it succeeds (exit 0), fails at a step or is cancelled (exit 1)."""
    from pipeline.flows import start as start_flow

    flow = _declared(name, as_json)
    if sum((input_json is not None, input_file is not None, example)) != 1:
        raise fail(
            "give the input once: as JSON (or @file, or - for stdin), --input-file PATH, or --example", 2, as_json
        )
    if example and flow.example is None:
        raise fail(f"flow {name} has no example input", 2, as_json)
    given = flow.example if example else read_payload(f"@{input_file}" if input_file else input_json, [])
    with exits(as_json, {}):
        flow_id = start_flow(flow, given or {}, idempotency_key=idempotency_key)
    if not wait:
        emit_json({"id": flow_id, "flow": name}) if as_json else typer.echo(flow_id)
        return
    if not as_json:
        typer.echo(f"flow {name} {flow_id}", err=True)
    _finish(follow(flow_id, timeout, show=not as_json), as_json, timeout)


@app.command("status")
def status(
    flow_id: IdArg,
    watch: Annotated[bool, typer.Option("--watch", help="Follow it to its end (exit 1 unless it succeeds).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """A flow step by step: each step's state, jobs done/total and progress; the flow's state and failed step."""
    from pipeline.control.flows import flow_status
    from pipeline.flows import FlowNotFound

    try:
        current = flow_status(flow_id)
    except FlowNotFound as exc:
        raise fail(str(exc), 2, as_json) from None
    if watch:
        _finish(follow(flow_id, float("inf"), show=not as_json), as_json, float("inf"))
        return
    emit_json(current.model_dump(mode="json")) if as_json else typer.echo("\n".join(status_lines(current)))


@app.command("list")
def list_(
    flow: Annotated[str | None, typer.Option("--flow", help="Only flows of this name.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Recent flows, newest first: state, progress, when they started, the step a failed one failed at."""
    from pipeline.control.flows import list_flows

    if flow is not None:
        _declared(flow, as_json)
    rows = list_flows(limit, flow)
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    if not rows:
        typer.echo("no flows" + (f" named {flow}" if flow else ""))
        return
    typer.echo(f"{'ID':36}  {'FLOW':12} {'STATE':10} {'PROGRESS':>8}  {'STARTED (UTC)':19}  FAILED STEP")
    for r in rows:
        typer.echo(
            f"{r.id:36}  {r.flow:12} {r.state:10} {r.progress:7.1f}%  {_time(r.created_at):19}  {r.failed_step or ''}"
        )


@app.command("cancel")
def cancel(flow_id: IdArg, as_json: JsonOpt = False) -> None:
    """Cancel a flow: no further step is queued; its waiting and running jobs are cancelled.

    Exit 1 if it has finished already (succeeded or cancelled), 2 if no flow has this id."""
    from pipeline.control.flows import FlowFinished, cancel_flow
    from pipeline.flows import FlowNotFound

    with exits(as_json, {FlowNotFound: 2, FlowFinished: 1}):
        done = cancel_flow(flow_id)
    emit_json(done.model_dump(mode="json")) if as_json else typer.echo(f"{flow_id} cancelled")
