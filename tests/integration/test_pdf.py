"""pdf.render through a real worker: the stored file opens in an independent reader."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from pypdf import PdfReader

from tasks.pdf import render
from tests.support.inproc import InProcessWorker
from tests.unit.test_pdf import INVOICE

pytestmark = pytest.mark.integration


def test_invoice_job_stores_a_readable_pdf(session_worker: InProcessWorker) -> None:
    task_id = render.enqueue({"template_id": "invoice", "data": INVOICE, "filename": "INV-42.pdf"})
    result = render.result(task_id, timeout=60)
    path = Path(urlsplit(result.uri).path)
    assert path.name == "INV-42.pdf"
    assert task_id in path.parts
    reader = PdfReader(path, strict=True)
    assert result.pages == len(reader.pages) == 1
    assert "Total: EUR 1,460.24" in reader.pages[0].extract_text()
    assert result.bytes == path.stat().st_size
    assert not list((path.parents[2] / ".partial").iterdir())  # nothing left under a temporary name


def test_report_job(session_worker: InProcessWorker) -> None:
    rows = [[i, f"row {i}"] for i in range(300)]
    data = {"title": "Weekly", "columns": ["n", "label"], "rows": rows}
    task_id = render.enqueue({"template_id": "report", "data": data})
    result = render.result(task_id, timeout=60)
    reader = PdfReader(Path(urlsplit(result.uri).path), strict=True)
    assert result.pages == len(reader.pages) >= 5
    assert reader.pages[0].extract_text().startswith("Weekly")


def test_large_report_streams_its_rows_from_storage(session_worker: InProcessWorker) -> None:
    """Thousands of pages: the rows come from a stored JSON Lines file, not from the message."""
    import json

    from pipeline.storage import get_storage

    storage = get_storage()
    rows = 40_000
    with storage.open_write("inputs/big-report.jsonl") as out:
        for i in range(rows):
            out.write(json.dumps([i, f"line item {i}", i * 1.5]).encode() + b"\n")
    data = {"title": "Yearly ledger", "columns": ["n", "label", "amount"], "rows_from": "inputs/big-report.jsonl"}
    task_id = render.enqueue({"template_id": "report", "data": data})
    result = render.result(task_id, timeout=240)
    reader = PdfReader(Path(urlsplit(result.uri).path))
    assert result.pages == len(reader.pages) > 500
    assert reader.pages[0].extract_text().startswith("Yearly ledger")
    assert f"line item {rows - 1}" in reader.pages[-1].extract_text()


def test_report_rows_from_a_missing_object_is_dead_lettered(session_worker: InProcessWorker, clean_dlq: None) -> None:
    from tests.support.dlq import dead_letter

    data = {"title": "Nothing", "columns": ["n"], "rows_from": "inputs/absent.jsonl"}
    entry = dead_letter(render.enqueue({"template_id": "report", "data": data}))
    assert entry.exception_type == "pipeline.errors.PermanentError"
    assert "no stored object 'inputs/absent.jsonl'" in entry.exception_message
    assert entry.attempts == 1
