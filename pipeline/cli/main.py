"""The `pipeline` command: run the local stack, enqueue jobs, follow them, operate queues and the DLQ.

Every command prints for a person by default and JSON with `--json`.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any

import typer

from pipeline.cli import dlq as cli_dlq
from pipeline.cli import flows as cli_flows
from pipeline.cli import queues as cli_queues
from pipeline.cli.output import (
    broker_errors,
    emit_json,
    exits,
    fail,
    parse_time,
    read_payload,
    read_payloads,
)
from pipeline.compat import PRODUCER_LIBRARIES, versions
from pipeline.config import get_settings
from pipeline.errors import PriorityInvalid
from pipeline.status import JobState, JobStatus, job_status

app = typer.Typer(
    help="Operate the job pipeline. Celery itself stays `celery -A pipeline ...`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(cli_dlq.app, name="dlq")
app.add_typer(cli_queues.app, name="queues")
app.add_typer(cli_flows.app, name="flow")


@app.callback()
def _start() -> None:
    """Read and validate the settings once, before any command: a bad value stops here, naming the variable. The
    command writes jobs itself, so a Celery, kombu or redis-py it was not verified on stops it here too (exit 2)."""
    versions.require("CLI", PRODUCER_LIBRARIES, get_settings().allow_unverified_versions)


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
PriorityOpt = Annotated[
    int | None,
    typer.Option(help="0 (most urgent) to 9; default TASK_DEFAULT_PRIORITY. Workers take urgent levels first."),
]


@app.command()
def run(
    with_api: Annotated[bool, typer.Option("--api/--no-api", help="Also serve the producer API.")] = True,
) -> None:
    """Start the local stack: Redis (embedded unless REDIS_URL is set), a worker, beat and Flower."""
    from pipeline.cli.stack import run_stack

    raise typer.Exit(run_stack(with_api=with_api))


GROUP_HELP = "The jobs' group (a tenant): taken in turns with other groups; GROUP_CONCURRENCY caps it."


@app.command()
def enqueue(
    kind: Annotated[str, typer.Argument(help="Job kind (see `pipeline kinds`) or full task name.")],
    payload: Annotated[str | None, typer.Argument(help="JSON object, @file, or - for stdin.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="key=value (dots nest), repeatable.")] = None,
    delay: Annotated[float | None, typer.Option(help="Run after this many seconds.")] = None,
    at: Annotated[str | None, typer.Option(help="Run at this time (ISO 8601, UTC if no offset).")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Same key → same job, not a second one.")] = None,
    priority: PriorityOpt = None,
    group: Annotated[str | None, typer.Option(help=GROUP_HELP)] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job to its end, with progress.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after this many seconds.")] = 3600,
    as_json: JsonOpt = False,
) -> None:
    """Validate a payload and publish the job; print its id (and with --wait, its result)."""
    typed = _typed(kind, as_json)
    eta: datetime | None = parse_time(at) if at else None
    with exits(as_json, {PriorityInvalid: 2}):
        task_id = typed.enqueue(
            read_payload(payload, set_ or []),
            countdown=delay,
            eta=eta,
            idempotency_key=idempotency_key,
            priority=priority,
            group=group,
        )
    if not wait:
        emit_json({"id": task_id, "task": typed.name}) if as_json else typer.echo(task_id)
        return
    if not as_json:
        typer.echo(f"{typed.name} {task_id}", err=True)
    status = _follow(task_id, timeout, show=not as_json)
    if as_json:
        emit_json(status.model_dump(mode="json"))
    elif status.state == JobState.SUCCEEDED:
        typer.echo(_dumps(status.result))
    if not status.final:
        typer.secho(f"timeout: still {status.state} after {timeout}s", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    if status.state != JobState.SUCCEEDED:
        if not as_json:
            error = f"{status.error.type}: {status.error.message}" if status.error else None
            typer.secho(f"{status.state}: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@app.command("enqueue-many")
def enqueue_many(
    kind: Annotated[str, typer.Argument(help="Job kind (see `pipeline kinds`) or full task name.")],
    payloads: Annotated[str, typer.Argument(help="A JSON array or JSON Lines: @file, - for stdin, or the text.")],
    priority: PriorityOpt = None,
    group: Annotated[str | None, typer.Option(help=GROUP_HELP)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Validate every payload, then publish one job each (all or none); print their ids in order."""
    typed = _typed(kind, as_json)
    with exits(as_json, {PriorityInvalid: 2}):
        ids = typed.enqueue_many(read_payloads(payloads), priority=priority, group=group)
    if as_json:
        emit_json({"task": typed.name, "ids": ids})
    else:
        typer.echo("\n".join(ids))


def _typed(kind: str, as_json: bool) -> Any:
    """The typed task of a kind or task name (exit 2 naming the known kinds if there is none)."""
    from pipeline.task import load_task_modules

    tasks = load_task_modules()
    typed = tasks.get(kind) or next((t for t in tasks.values() if t.name == kind), None)
    if typed is None:
        raise fail(f"unknown kind {kind!r}; known: {', '.join(sorted(tasks))}", 2, as_json)
    return typed


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, indent=2, default=str)


def _follow(task_id: str, timeout: float, show: bool) -> JobStatus:
    """Poll the job's status until it is final (or `timeout` passed: then it is returned not final)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    deadline = time.monotonic() + timeout
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeRemainingColumn(),
        disable=not show,
        transient=True,
    ) as bar:
        handle = bar.add_task(JobState.QUEUED, total=100)
        while True:
            status = job_status(task_id)
            percent = status.progress.percent if status.progress else 0
            bar.update(handle, description=status.state, completed=percent)
            if status.final or time.monotonic() > deadline:
                return status
            time.sleep(0.25)


@app.command()
def status(task_id: Annotated[str, typer.Argument(metavar="ID")], as_json: JsonOpt = False) -> None:
    """Show a job's state, progress, result or error."""
    state = job_status(task_id).model_dump(mode="json")
    if as_json:
        emit_json(state)
        return
    for key, value in state.items():
        if value not in (None, {}, ""):
            typer.echo(f"{key + ':':10} {_dumps(value) if isinstance(value, dict | list) else value}")


@app.command()
def cancel(task_id: Annotated[str, typer.Argument(metavar="ID")], as_json: JsonOpt = False) -> None:
    """Cancel a job: waiting, scheduled or retrying, it never runs; running, it is stopped. It ends `cancelled`.

    Exit 1 if it has finished already, 2 if no job has this id."""
    from pipeline.control.cancel import JobFinished, JobNotFound
    from pipeline.control.cancel import cancel as cancel_job

    with exits(as_json, {JobNotFound: 2, JobFinished: 1}):
        status = cancel_job(task_id)
    if as_json:
        emit_json(status.model_dump(mode="json"))
    else:
        typer.echo(f"{task_id} cancelled")


@app.command()
def exporter(
    port: Annotated[int | None, typer.Option(help="Port to serve /metrics on (default: EXPORTER_PORT).")] = None,
    address: Annotated[str, typer.Option(help="Address to bind.")] = "0.0.0.0",  # noqa: S104  # scraped remotely
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", "-q", help="Queue to report (repeatable; default: every queue the app routes to)."),
    ] = None,
) -> None:
    """Serve queue depth, in-flight jobs, oldest job age and DLQ size for Prometheus (run one)."""
    from pipeline.observability.exporter import run_exporter

    run_exporter(port or get_settings().exporter_port, address, queue or None)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    processes: Annotated[
        int | None,
        typer.Option(min=1, help="Celery worker processes to run [default: CPUs + 1]."),
    ] = None,
    name: Annotated[str, typer.Option(help="Node names are <name><i>@%h.")] = "io",
    celery_app: Annotated[str, typer.Option("--app", help="What `celery -A` loads.")] = "pipeline",
    pool: Annotated[
        str,
        typer.Option(help="asyncio: WORKER_CONCURRENCY jobs in flight per process; solo: one job at a time each."),
    ] = "asyncio",
) -> None:
    """The I/O profile: N `celery worker` processes under one supervisor, one /metrics for all.

    Arguments after the options go to each `celery worker` (e.g. `-Q email,webhooks -l INFO`)."""
    from pipeline.cli.workers import default_processes, run_workers

    if pool not in ("asyncio", "solo"):
        raise typer.BadParameter(f"{pool!r} is not one of 'asyncio', 'solo'", param_hint="--pool")
    count = processes or default_processes()
    raise typer.Exit(run_workers(celery_app, name, count, list(ctx.args), pool))


@app.command("worker-health")
def worker_health(
    node: Annotated[
        str, typer.Option(help="Worker node name as given to `celery worker -n` (`%h`: this host's name).")
    ] = "celery@%h",
    as_json: JsonOpt = False,
) -> None:
    """Liveness of the worker on this host, from its heartbeat file: exit 0 when healthy, 1 and why otherwise."""
    import socket

    from pipeline.observability.health import check_heartbeat, health_paths

    # A glob (`io*@%h`: the workers of `pipeline worker --processes`) checks every node it matches.
    paths = health_paths(get_settings().worker_health_dir, node.replace("%h", socket.gethostname()))
    verdicts = [check_heartbeat(path) for path in paths]
    verdict = next((v for v in verdicts if not v.healthy), verdicts[0])
    if as_json:
        emit_json({"healthy": verdict.healthy, "reason": verdict.reason, "heartbeat": verdict.record})
    elif verdict.healthy:
        typer.echo(verdict.reason)
    else:
        typer.echo(f"unhealthy: {verdict.reason}", err=True)
    if not verdict.healthy:
        raise typer.Exit(1)


@app.command()
def kinds(as_json: JsonOpt = False) -> None:
    """List the job kinds `enqueue` accepts, with their task names and queues."""
    from pipeline.celery_app import get_app
    from pipeline.task import load_task_modules

    rows = [
        {"kind": k, "task": t.name, "queue": get_app().amqp.router.route({}, t.name)["queue"].name}
        for k, t in sorted(load_task_modules().items())
    ]
    if as_json:
        emit_json(rows)
        return
    for r in rows:
        typer.echo(f"{r['kind']:16} {r['task']:24} queue={r['queue']}")


def main() -> None:
    with broker_errors():
        app()


if __name__ == "__main__":
    main()
