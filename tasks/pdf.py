"""`pdf.render`: lay out a typed template (`invoice`, `report`) as a PDF, streamed page by page to storage.

`data` is validated against the template's model at enqueue, so a malformed invoice never reaches
the broker. The file is written under a temporary name and moved to `pdf/<task id>/<filename>` only
when complete (see pipeline.storage); a retry of the same job overwrites the same key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from pipeline.errors import PermanentError
from pipeline.storage import Storage, get_storage
from pipeline.task import JobContext, typed_task
from tasks.pdf_models import Cell, ReportData
from tasks.pdf_stream import StreamingCanvas
from tasks.pdf_templates import TEMPLATES, draw_report

#: An invoice `pdf.render` takes (the API's and the page's example; the `invoice` flow's too).
INVOICE_EXAMPLE: dict[str, Any] = {
    "number": "INV-1001",
    "issued_on": "2026-11-29",
    "customer": {"name": "Ada Lovelace", "address": "12 Analytical Row, London"},
    "items": [
        {"description": "Consulting", "quantity": "3", "unit_price": "120.00"},
        {"description": "Support plan", "quantity": "1", "unit_price": "49.90"},
    ],
    "currency": "EUR",
}


class PdfJob(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "template_id": "invoice",
                    "data": INVOICE_EXAMPLE,
                    "filename": "invoice-1001.pdf",
                }
            ]
        },
    )

    template_id: Literal["invoice", "report"]
    #: The template's data: see `tasks.pdf_templates.InvoiceData` / `ReportData`.
    data: dict[str, Any]
    #: Name of the stored file. Default: `<template_id>.pdf`.
    filename: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}\.pdf$")

    @model_validator(mode="after")
    def _data_matches_template(self) -> PdfJob:
        self.typed_data()
        return self

    def typed_data(self) -> BaseModel:
        try:
            return TEMPLATES[self.template_id].model.model_validate(self.data)
        except ValidationError as exc:
            problems = "; ".join(
                f"data.{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"invalid data for template {self.template_id!r}: {problems}") from None


_ROW: TypeAdapter[list[Cell]] = TypeAdapter(list[Cell])


class PdfResult(BaseModel):
    uri: str
    pages: int
    bytes: int
    sha256: str


def output_key(task_id: str, filename: str) -> str:
    return f"pdf/{task_id}/{filename}"


def stored_rows(storage: Storage, key: str, width: int) -> Iterator[list[Cell]]:
    """Rows of a report from a stored JSON Lines file, one at a time; a bad line is a permanent error."""
    try:
        for number, line in enumerate(storage.read_lines(key), 1):
            if not line.strip():
                continue
            try:
                row = _ROW.validate_json(line)
            except ValidationError as exc:
                raise PermanentError(f"rows_from {key!r} line {number}: {exc.errors()[0]['msg']}") from None
            if len(row) != width:
                raise PermanentError(f"rows_from {key!r} line {number}: {len(row)} cells; columns has {width}")
            yield row
    except FileNotFoundError:
        raise PermanentError(f"rows_from: no stored object {key!r}") from None


def render_job(job: PdfJob, key: str, storage: Storage) -> PdfResult:
    """Render `job` to `key` in `storage` (write-then-rename)."""
    template = TEMPLATES[job.template_id]
    data = job.typed_data()
    with storage.open_write(key) as out:
        canvas = StreamingCanvas(out)
        if isinstance(data, ReportData) and data.rows_from:
            rows = stored_rows(storage, data.rows_from, len(data.columns))
            draw_report(canvas, data.title, data.columns, rows, data.summary)
        else:
            template.draw(canvas, data)
        canvas.save()
    return PdfResult(uri=storage.uri(key), pages=canvas.pages, bytes=canvas.bytes_written, sha256=canvas.sha256)


def render_report(
    storage: Storage,
    key: str,
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Cell]],
    summary: str | None = None,
) -> PdfResult:
    """A report from rows produced lazily (a generator, a database cursor): memory stays flat at any size."""
    with storage.open_write(key) as out:
        canvas = StreamingCanvas(out)
        draw_report(canvas, title, columns, rows, summary)
        canvas.save()
    return PdfResult(uri=storage.uri(key), pages=canvas.pages, bytes=canvas.bytes_written, sha256=canvas.sha256)


# track_started: a render takes seconds, so its status reads "started" from the moment a worker takes it.
@typed_task("pdf.render", kind="pdf", payload=PdfJob, result=PdfResult, track_started=True)
def render(job: PdfJob, ctx: JobContext) -> PdfResult:
    """Render one PDF to the storage backend."""
    return render_job(job, output_key(ctx.task_id, job.filename or f"{job.template_id}.pdf"), get_storage())


enqueue = render.enqueue
