"""PDF templates: the drawing code that lays each template's data out on a reportlab canvas.

`TEMPLATES` maps a `template_id` to its data model (`tasks.pdf_models`, validated at enqueue) and
its draw function.
Drawing is page by page on a `StreamingCanvas`, so a report of thousands of pages never sits in
memory: `draw_report` takes its rows as any iterable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal
from typing import Any, NamedTuple

from pydantic import BaseModel
from reportlab.lib.pagesizes import A4
from reportlab.pdfbase.pdfmetrics import stringWidth
from reportlab.pdfgen.canvas import Canvas

from tasks.pdf_models import Cell, InvoiceData, ReportData

WIDTH, HEIGHT = A4
MARGIN = 50.0


def money(amount: Decimal, currency: str) -> str:
    return f"{currency} {amount:,.2f}"


def fit(text: str, width: float, font: str, size: float) -> str:
    """`text` cut (with an ellipsis) to fit in `width` points."""
    if stringWidth(text, font, size) <= width:
        return text
    while text and stringWidth(text + "...", font, size) > width:
        text = text[:-1]
    return text + "..."


def footer(canvas: Canvas, label: str) -> None:
    canvas.setFont("Helvetica", 8)
    canvas.drawRightString(WIDTH - MARGIN, MARGIN / 2, f"{label} - page {canvas.getPageNumber()}")


def draw_invoice(canvas: Canvas, data: InvoiceData) -> None:
    canvas.setTitle(f"Invoice {data.number}")
    y = HEIGHT - MARGIN
    canvas.setFont("Helvetica-Bold", 20)
    canvas.drawString(MARGIN, y, f"Invoice {data.number}")
    canvas.setFont("Helvetica", 10)
    canvas.drawRightString(WIDTH - MARGIN, y, f"Issued on {data.issued_on.isoformat()}")
    y -= 30
    for line in [data.customer.name, *data.customer.address.splitlines()]:
        canvas.drawString(MARGIN, y, fit(line, WIDTH / 2, "Helvetica", 10))
        y -= 14
    columns = [(MARGIN, "Description"), (330.0, "Quantity"), (420.0, "Unit price"), (WIDTH - MARGIN, "Amount")]

    def header(y: float) -> float:
        canvas.setFont("Helvetica-Bold", 10)
        canvas.drawString(columns[0][0], y, columns[0][1])
        for x, label in columns[1:]:
            canvas.drawRightString(x + (60 if x < WIDTH - MARGIN else 0), y, label)
        canvas.line(MARGIN, y - 4, WIDTH - MARGIN, y - 4)
        canvas.setFont("Helvetica", 10)
        return y - 18

    y = header(y - 20)
    for item in data.items:
        if y < MARGIN + 40:
            footer(canvas, f"Invoice {data.number}")
            canvas.showPage()
            y = header(HEIGHT - MARGIN)
        canvas.drawString(MARGIN, y, fit(item.description, 260, "Helvetica", 10))
        canvas.drawRightString(390, y, f"{item.quantity.normalize():f}")
        canvas.drawRightString(480, y, money(item.unit_price, data.currency))
        canvas.drawRightString(WIDTH - MARGIN, y, money(item.total, data.currency))
        y -= 16
    canvas.line(MARGIN, y + 10, WIDTH - MARGIN, y + 10)
    canvas.setFont("Helvetica-Bold", 12)
    canvas.drawRightString(WIDTH - MARGIN, y - 8, f"Total: {money(data.total, data.currency)}")
    footer(canvas, f"Invoice {data.number}")
    canvas.showPage()


def draw_report(
    canvas: Canvas, title: str, columns: Sequence[str], rows: Iterable[Sequence[Cell]], summary: str | None = None
) -> None:
    """A table over as many pages as the rows need; rows are consumed one at a time."""
    canvas.setTitle(title)
    cell_width = (WIDTH - 2 * MARGIN) / len(columns)
    row_height = 13.0

    def start_page(first: bool) -> float:
        y = HEIGHT - MARGIN
        canvas.setFont("Helvetica-Bold", 16 if first else 10)
        canvas.drawString(MARGIN, y, fit(title, WIDTH - 2 * MARGIN, "Helvetica-Bold", 16 if first else 10))
        y -= 28 if first else 20
        canvas.setFont("Helvetica-Bold", 9)
        for i, name in enumerate(columns):
            canvas.drawString(MARGIN + i * cell_width, y, fit(name, cell_width - 4, "Helvetica-Bold", 9))
        canvas.line(MARGIN, y - 4, WIDTH - MARGIN, y - 4)
        canvas.setFont("Helvetica", 9)
        return y - row_height - 4

    y = start_page(first=True)
    for row in rows:
        if y < MARGIN + row_height:
            footer(canvas, title)
            canvas.showPage()
            y = start_page(first=False)
        for i, cell in enumerate(row):
            canvas.drawString(MARGIN + i * cell_width, y, fit(str(cell), cell_width - 4, "Helvetica", 9))
        y -= row_height
    if summary:
        canvas.setFont("Helvetica", 10)
        for line in summary.splitlines() or [""]:
            if y < MARGIN + row_height:
                footer(canvas, title)
                canvas.showPage()
                y = HEIGHT - MARGIN
                canvas.setFont("Helvetica", 10)
            y -= 6
            canvas.drawString(MARGIN, y, fit(line, WIDTH - 2 * MARGIN, "Helvetica", 10))
            y -= row_height
    footer(canvas, title)
    canvas.showPage()


class Template(NamedTuple):
    model: type[BaseModel]
    draw: Callable[[Canvas, Any], None]


def _draw_report_data(canvas: Canvas, data: ReportData) -> None:
    draw_report(canvas, data.title, data.columns, data.rows, data.summary)


TEMPLATES: dict[str, Template] = {
    "invoice": Template(InvoiceData, draw_invoice),
    "report": Template(ReportData, _draw_report_data),
}
