"""The typed data of each PDF template, validated at enqueue: `invoice` and `report`."""

from __future__ import annotations

from datetime import date
from decimal import ROUND_HALF_UP, Decimal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Cell = str | int | float
CENT = Decimal("0.01")


class Customer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    address: str = Field(default="", max_length=1000)


class InvoiceItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = Field(min_length=1, max_length=300)
    quantity: Decimal = Field(gt=0, max_digits=12, decimal_places=3)
    unit_price: Decimal = Field(ge=0, max_digits=14, decimal_places=2)

    @property
    def total(self) -> Decimal:
        return (self.quantity * self.unit_price).quantize(CENT, ROUND_HALF_UP)


class InvoiceData(BaseModel):
    """Totals are computed from the items, never passed in."""

    model_config = ConfigDict(extra="forbid")
    number: str = Field(min_length=1, max_length=64)
    issued_on: date
    customer: Customer
    items: list[InvoiceItem] = Field(min_length=1, max_length=2000)
    currency: str = Field(pattern=r"^[A-Z]{3}$")

    @property
    def total(self) -> Decimal:
        return sum((item.total for item in self.items), Decimal("0.00"))


class ReportData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(min_length=1, max_length=200)
    columns: list[str] = Field(min_length=1, max_length=12)
    rows: list[list[Cell]] = Field(default_factory=list)
    #: Instead of `rows`: a key in the storage backend holding the rows as JSON Lines (one array per line),
    #: streamed while rendering, for reports larger than a message may carry (thousands of pages).
    rows_from: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,300}$")
    summary: str | None = Field(default=None, max_length=5000)

    @model_validator(mode="after")
    def _row_width(self) -> ReportData:
        if self.rows and self.rows_from:
            raise ValueError("give rows or rows_from, not both")
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"rows[{i}] has {len(row)} cells; columns has {len(self.columns)}")
        return self
