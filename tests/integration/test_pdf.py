"""pdf.render through a real worker: the stored file opens in an independent reader."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from pypdf import PdfReader

from tasks.pdf import render
from tests.support.procs import Worker
from tests.unit.test_pdf import INVOICE

pytestmark = pytest.mark.integration


def test_invoice_job_stores_a_readable_pdf(session_worker: Worker) -> None:
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


def test_report_job(session_worker: Worker) -> None:
    rows = [[i, f"row {i}"] for i in range(300)]
    data = {"title": "Weekly", "columns": ["n", "label"], "rows": rows}
    task_id = render.enqueue({"template_id": "report", "data": data})
    result = render.result(task_id, timeout=60)
    reader = PdfReader(Path(urlsplit(result.uri).path), strict=True)
    assert result.pages == len(reader.pages) >= 5
    assert reader.pages[0].extract_text().startswith("Weekly")
