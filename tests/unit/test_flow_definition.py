"""A flow definition is checked when it is declared: names, the steps it runs after, and the types its mappings hand
over, against the tasks' payload and result models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from pipeline.flows import FLOWS, Flow, FlowInvalid
from tasks.media import TranscodeJob, TranscodeResult, transcode
from tasks.pdf import PdfJob, PdfResult, render
from tasks.webhooks import WebhookJob, deliver


class Order(BaseModel):
    source: str


@pytest.fixture
def flow() -> Iterator[Flow[Order]]:
    declared = Flow("unit_flow", Order)
    yield declared
    FLOWS.pop("unit_flow", None)


def _pdf(order: Order) -> PdfJob:
    raise NotImplementedError


def test_a_well_typed_flow_is_declared_with_its_fan_out_and_join(flow: Flow[Order]) -> None:
    @flow.step("cut", transcode, each=True)
    def cut(order: Order) -> list[TranscodeJob]:
        return []

    @flow.step("tell", deliver, after=["cut"])
    def tell(order: Order, cut: list[TranscodeResult]) -> WebhookJob:
        raise NotImplementedError

    assert list(flow.steps) == ["cut", "tell"] and flow.steps["cut"].children == ["tell"]
    assert flow.joins(flow.steps["tell"]) and not flow.joins(flow.steps["cut"])
    assert FLOWS["unit_flow"] is flow


def test_a_mapping_must_return_the_tasks_payload(flow: Flow[Order]) -> None:
    def wrong(order: Order) -> WebhookJob:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match=r"step 'render': `return` is annotated WebhookJob; the flow gives PdfJob"):
        flow.step("render", render)(wrong)


def test_a_parent_result_must_be_what_the_parent_returns(flow: Flow[Order]) -> None:
    flow.step("render", render)(_pdf)

    def wrong(order: Order, render: TranscodeResult) -> WebhookJob:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match="`render` is annotated TranscodeResult; the flow gives PdfResult"):
        flow.step("tell", deliver, after=["render"])(wrong)


def test_a_fan_out_parent_hands_over_a_list(flow: Flow[Order]) -> None:
    def cut(order: Order) -> list[TranscodeJob]:
        return []

    flow.step("cut", transcode, each=True)(cut)

    def single(order: Order, cut: TranscodeResult) -> WebhookJob:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match="`cut` is annotated TranscodeResult"):
        flow.step("tell", deliver, after=["cut"])(single)


def test_the_input_must_be_the_flows_input_model(flow: Flow[Order]) -> None:
    def wrong(order: PdfResult) -> PdfJob:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match="`order` is annotated PdfResult; the flow gives Order"):
        flow.step("render", render)(wrong)


def test_parameters_name_the_steps_it_runs_after(flow: Flow[Order]) -> None:
    flow.step("render", render)(_pdf)

    def misnamed(order: Order, pdf: PdfResult) -> WebhookJob:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match=r"then \['render'\] by name \(has \['pdf'\]\)"):
        flow.step("tell", deliver, after=["render"])(misnamed)


@pytest.mark.parametrize(
    ("name", "after", "each", "message"),
    [
        ("Bad-Name", (), False, "lower-case letters"),
        ("tell", ("nowhere",), False, "must name steps declared before it"),
        ("tell", ("render", "render"), False, "once each"),
        ("again", ("cut",), True, "not after a fan-out"),
        ("render", (), False, "declared twice"),
    ],
)
def test_names_order_and_fan_out_rules_are_checked(
    flow: Flow[Order], name: str, after: tuple[str, ...], each: bool, message: str
) -> None:
    flow.step("render", render)(_pdf)

    def cut(order: Order) -> list[TranscodeJob]:
        return []

    flow.step("cut", transcode, each=True)(cut)

    def anything(*args: Any) -> Any:
        raise NotImplementedError

    with pytest.raises(FlowInvalid, match=message):
        flow.step(name, deliver, after=after, each=each)(anything)


def test_a_flow_name_is_declared_once(flow: Flow[Order]) -> None:
    with pytest.raises(FlowInvalid, match="declared twice"):
        Flow("unit_flow", Order)
    with pytest.raises(FlowInvalid, match="lower-case"):
        Flow("Unit", Order)


def test_the_shipped_flows_are_declared() -> None:
    from tasks import flows

    assert list(flows.invoice.steps) == ["render", "email"]
    assert list(flows.media_flow.steps) == ["transcode", "notify"] and flows.media_flow.steps["transcode"].each
    assert flows.invoice.input_model.model_validate(flows.invoice.example)
    assert flows.media_flow.input_model.model_validate(flows.media_flow.example)
