"""pdf.render's templates, checked with an independent reader (pypdf); bad data refused at enqueue."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from pypdf import PdfReader

from pipeline.errors import PayloadInvalid
from pipeline.storage import LocalStorage
from tasks.pdf import PdfJob, render, render_job, render_report

INVOICE: dict[str, Any] = {
    "number": "INV-2026-0042",
    "issued_on": "2026-11-29",
    "customer": {"name": "Ada Lovelace", "address": "12 Analytical Row\nLondon"},
    "items": [
        {"description": "Consulting", "quantity": "3", "unit_price": "450.00"},
        {"description": "Travel", "quantity": 1, "unit_price": "99.99"},
        {"description": "Notebooks", "quantity": "2.5", "unit_price": "4.10"},
    ],
    "currency": "EUR",
}

ZERO_QUANTITY = {"description": "x", "quantity": 0, "unit_price": 1}


def test_invoice_total_is_computed(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    result = render_job(PdfJob(template_id="invoice", data=INVOICE), "inv.pdf", storage)
    path = tmp_path / "inv.pdf"
    reader = PdfReader(path, strict=True)
    text = reader.pages[0].extract_text()
    assert result.pages == len(reader.pages) == 1
    assert "Invoice INV-2026-0042" in text
    assert "Ada Lovelace" in text
    assert "Total: EUR 1,460.24" in text  # 1350.00 + 99.99 + 10.25
    assert result.bytes == path.stat().st_size
    assert result.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert result.uri == path.resolve().as_uri()


def test_long_invoice_spans_pages(tmp_path: Path) -> None:
    items = [{"description": f"Item {i}", "quantity": 1, "unit_price": "1.00"} for i in range(120)]
    job = PdfJob(template_id="invoice", data={**INVOICE, "items": items})
    result = render_job(job, "long.pdf", LocalStorage(tmp_path))
    reader = PdfReader(tmp_path / "long.pdf", strict=True)
    assert result.pages == len(reader.pages) >= 3
    assert "Total: EUR 120.00" in reader.pages[-1].extract_text()


def test_report_pages_title_and_summary(tmp_path: Path) -> None:
    rows = ([i, f"name {i}", i * 1.5] for i in range(2000))  # a generator: rows are consumed one at a time
    result = render_report(
        LocalStorage(tmp_path), "r.pdf", "Quarterly numbers", ["id", "name", "value"], rows, "All good."
    )
    reader = PdfReader(tmp_path / "r.pdf", strict=True)
    assert result.pages == len(reader.pages) >= 30
    first, last = reader.pages[0].extract_text(), reader.pages[-1].extract_text()
    assert "Quarterly numbers" in first
    assert "name 0" in first
    assert "name 1999" in last
    assert "All good." in last
    assert f"page {result.pages}" in last


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"template_id": "invoice", "data": {**INVOICE, "items": []}}, "data.items"),
        ({"template_id": "invoice", "data": {**INVOICE, "currency": "euro"}}, "data.currency"),
        ({"template_id": "invoice", "data": {**INVOICE, "total": "5.00"}}, "data.total"),  # totals are computed
        ({"template_id": "invoice", "data": {**INVOICE, "items": [ZERO_QUANTITY]}}, "data.items.0.quantity"),
        ({"template_id": "report", "data": {"title": "t", "columns": ["a", "b"], "rows": [[1]]}}, "rows[0] has 1"),
        ({"template_id": "report", "data": {"columns": ["a"]}}, "data.title"),
        ({"template_id": "letter", "data": {}}, "template_id"),
        ({"template_id": "report", "data": {"title": "t", "columns": ["a"]}, "filename": "../x.pdf"}, "filename"),
    ],
)
def test_malformed_data_refused_at_enqueue(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadInvalid, match=r"pdf\.render") as info:
        render.enqueue(payload)  # raises before anything is published
    assert message in str(info.value)
