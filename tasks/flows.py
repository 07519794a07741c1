"""The shipped flows: `invoice` (render a PDF, then email it) and `media` (three transcodes, then one webhook).

`invoice`: `pdf.render` renders the invoice, then `email.send` sends it to the recipients with the PDF attached (by
its storage URI: the email step reads it from the storage backend, so a replayed email step does not render again).

`media`: `media.transcode` runs once per preset, in parallel (a fan-out); when all have succeeded, `webhooks.deliver`
posts one signed event carrying the renditions' URIs, in preset order.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

from pipeline.flows import Flow
from pipeline.text import HeaderEmail
from tasks import email, media, pdf, webhooks
from tasks.email import EmailJob
from tasks.email_attachments import Attachment
from tasks.media import Preset, TranscodeJob, TranscodeResult
from tasks.pdf import PdfJob, PdfResult
from tasks.pdf_models import InvoiceData
from tasks.webhooks import WebhookJob

INVOICE_EXAMPLE: dict[str, Any] = {"invoice": pdf.INVOICE_EXAMPLE, "to": ["ada@example.com"]}


class InvoiceOrder(BaseModel):
    """Render an invoice PDF, then email it as an attachment."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [INVOICE_EXAMPLE]})
    #: The data `pdf.render`'s `invoice` template takes.
    invoice: InvoiceData
    to: list[HeaderEmail] = Field(min_length=1, max_length=email.MAX_RECIPIENTS)
    #: Who the email is from, as its text signs it.
    sender: str = Field(default="pipeline", min_length=1, max_length=200)


invoice = Flow("invoice", InvoiceOrder, example=INVOICE_EXAMPLE)


@invoice.step("render", pdf.render)
def render_invoice(order: InvoiceOrder) -> PdfJob:
    return PdfJob(
        template_id="invoice",
        data=order.invoice.model_dump(mode="json"),
        filename=f"invoice-{_safe(order.invoice.number)}.pdf",
    )


@invoice.step("email", email.send, after=["render"])
def email_invoice(order: InvoiceOrder, render: PdfResult) -> EmailJob:
    data = order.invoice
    total: Decimal = data.total
    return EmailJob(
        to=order.to,
        template_id="invoice",
        variables={
            "customer": data.customer.name,
            "number": data.number,
            "issued_on": data.issued_on.isoformat(),
            "total": f"{total:.2f}",
            "currency": data.currency,
            "sender": order.sender,
        },
        attachments=[Attachment(uri=render.uri, content_type="application/pdf")],
    )


def _safe(text: str) -> str:
    """An invoice number as part of a file name."""
    kept = "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip(".-")
    return kept[:60] or "invoice"


MEDIA_EXAMPLE: dict[str, Any] = {
    "source_uri": "sample.mp4",
    "presets": ["720p", "480p", "audio"],
    "notify_url": "https://example.com/hooks/media",
}


class MediaOrder(BaseModel):
    """Transcode one source into three presets in parallel, then deliver one signed webhook with the three URIs."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [MEDIA_EXAMPLE]})
    #: As `media.transcode` takes it: a path under MEDIA_ROOT, or an http(s) URL.
    source_uri: str = Field(min_length=1, max_length=4096)
    presets: list[Preset] = Field(default=["720p", "480p", "audio"], min_length=1, max_length=4)
    #: Where the `media.transcoded` event is POSTed (signed as every webhook is).
    notify_url: HttpUrl

    @field_validator("presets")
    @classmethod
    def _once_each(cls, presets: list[Preset]) -> list[Preset]:
        if len(set(presets)) != len(presets):
            raise ValueError("each preset once")
        return presets


media_flow = Flow("media", MediaOrder, example=MEDIA_EXAMPLE)


@media_flow.step("transcode", media.transcode, each=True)
def transcodes(order: MediaOrder) -> list[TranscodeJob]:
    return [TranscodeJob(source_uri=order.source_uri, preset=preset) for preset in order.presets]


@media_flow.step("notify", webhooks.deliver, after=["transcode"])
def notify(order: MediaOrder, transcode: list[TranscodeResult]) -> WebhookJob:
    renditions = [
        {"preset": preset, "uri": out.uri, "bytes": out.bytes, "duration_s": out.duration_s}
        for preset, out in zip(order.presets, transcode, strict=True)
    ]
    return WebhookJob(
        url=order.notify_url,
        event="media.transcoded",
        payload={"source_uri": order.source_uri, "renditions": renditions},
    )
