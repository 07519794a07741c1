"""`pipeline dlq`: list, show, replay, delete and purge dead-lettered jobs."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.output import BROKER_EXIT, emit_json, fail, parse_duration, parse_time
from pipeline.dlq import admin as dlq_admin
from pipeline.errors import BrokerWriteRefused

app = typer.Typer(help="Inspect and operate the dead-letter queue.", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
TaskOpt = Annotated[str | None, typer.Option("--task", help="Task name or glob, e.g. 'email.*'.")]
ExcOpt = Annotated[str | None, typer.Option("--exception", help="Exception class name.")]


@app.command("list")
def list_(
    task: TaskOpt = None,
    exception: ExcOpt = None,
    since: Annotated[str | None, typer.Option(help="ISO time, or an age like 1h / 2d.")] = None,
    limit: Annotated[int | None, typer.Option(help="Show at most this many (newest first).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List dead-lettered jobs, newest first."""
    filters = dlq_admin.Filters(task=task, exception=exception, since=parse_time(since) if since else None)
    rows = [e.row() for e in dlq_admin.list_entries(filters, limit)]
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    if not rows:
        typer.echo("dead-letter queue is empty" if not (task or exception or since) else "no matching entries")
        return
    typer.echo(f"{'ID':32}  {'FAILED AT (UTC)':19}  {'TASK':22}  {'TRIES':>5}  EXCEPTION")
    for r in rows:
        when = r.failed_at[:19].replace("T", " ")
        exc = r.exception.rsplit(".", 1)[-1]
        typer.echo(f"{r.id:32}  {when:19}  {r.task!s:22.22}  {r.attempts:>5}  {exc}: {r.message[:60]}")
    typer.echo(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")


@app.command()
def show(
    ident: Annotated[str, typer.Argument(metavar="ID", help="Entry id or original task id.")], as_json: JsonOpt = False
) -> None:
    """Show one entry whole: payload, error and traceback."""
    try:
        entry = dlq_admin.get(ident)
    except dlq_admin.DeadLetterNotFound as exc:
        raise fail(str(exc), as_json=as_json) from None
    if as_json:
        emit_json(entry.model_dump(mode="json"))
        return
    for key, value in entry.row().model_dump(mode="json").items():
        typer.echo(f"{key + ':':12} {value}")
    typer.echo(f"{'worker:':12} {entry.worker}")
    if entry.args is not None:
        typer.echo(f"{'payload:':12} {entry.payload if entry.payload is not None else entry.args}")
    if entry.body_preview:
        typer.echo(f"{'body:':12} {entry.body_preview[:500]}")
    if entry.body_size is not None:
        typer.echo(f"{'body size:':12} {entry.body_size} bytes, sha256 {entry.body_sha256}")
    if entry.deliveries:
        typer.echo("deliveries:")
        for n, delivery in enumerate(entry.deliveries, 1):
            typer.echo(f"  {n:>2}. {delivery.get('at')}  {delivery.get('worker')}")
    if entry.traceback:
        typer.echo("traceback:\n" + entry.traceback)


@app.command()
def replay(
    ident: Annotated[str | None, typer.Argument(metavar="[ID]")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Replay every replayable entry.")] = False,
    task: TaskOpt = None,
    exception: ExcOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run dead-lettered jobs again (new task id, original queue); each entry is removed once republished.

    A write the broker refuses (replicas did not confirm it in time, Redis at maxmemory) stops the run there, exit
    3: that entry stays, and replaying it again answers with the same new task id, never a second job."""
    if sum(bool(x) for x in (ident, all_, task or exception)) != 1:
        raise fail("give exactly one of: an ID, --all, or --task/--exception filters", 2, as_json)
    targets = (
        [ident]
        if ident
        else [e.id for e in dlq_admin.list_entries(dlq_admin.Filters(task=task, exception=exception)) if e.replayable]
    )
    done, errors, code = [], [], 1
    for target in targets:
        try:
            done.append({"id": target, "new_task_id": dlq_admin.replay(target)})
        except (dlq_admin.DeadLetterNotFound, dlq_admin.NotReplayable) as exc:
            errors.append({"id": target, "error": str(exc) or "not found"})
        except BrokerWriteRefused as exc:  # every next write would be refused too
            errors.append({"id": target, "error": str(exc)})
            code = BROKER_EXIT
            break
    if as_json:
        emit_json({"replayed": done, "errors": errors})
    else:
        for d in done:
            typer.echo(f"replayed {d['id']} as task {d['new_task_id']}")
        for e in errors:
            typer.secho(f"not replayed {e['id']}: {e['error']}", fg=typer.colors.RED, err=True)
        if not targets:
            typer.echo("nothing to replay")
    if errors:
        raise typer.Exit(code)


@app.command()
def delete(ident: Annotated[str, typer.Argument(metavar="ID")], as_json: JsonOpt = False) -> None:
    """Remove one entry without running it."""
    try:
        entry = dlq_admin.delete(ident)
    except dlq_admin.DeadLetterNotFound as exc:
        raise fail(str(exc), as_json=as_json) from None
    emit_json({"deleted": entry.id}) if as_json else typer.echo(f"deleted {entry.id}")


@app.command()
def purge(
    older_than: Annotated[str | None, typer.Option(help="Only entries older than this age (7d, 12h).")] = None,
    task: TaskOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove entries for good: all of them, or only those older than --older-than."""
    age = parse_duration(older_than) if older_than else None
    if age is None and task is None and not yes:
        typer.confirm("Remove EVERY dead-letter entry?", abort=True)
    removed = dlq_admin.purge(age, dlq_admin.Filters(task=task))
    emit_json({"removed": removed}) if as_json else typer.echo(
        f"removed {removed} entr{'y' if removed == 1 else 'ies'}"
    )
