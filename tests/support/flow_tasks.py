"""Flows that only tests run, built from the test tasks (`tests.support.ledger_tasks`): a chain, a fan-out with its
join, and a diamond (two parallel steps and their join). Each join records what it was given in its payload's key,
so a test reads from the ledger what the join saw, and how many times it ran."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pipeline.flows import Flow
from tests.support.ledger_tasks import LedgerJob, LedgerResult, RunJob, RunResult, ledger, run


class ChainInput(BaseModel):
    key: str
    #: "flag": the second step fails permanently while `test:flag:<key>:second` exists (then it dead-letters);
    #: "transient": its first attempt fails with a transient error (it retries).
    second: str = "none"


chain = Flow("test_chain", ChainInput)


@chain.step("first", run)
def first(order: ChainInput) -> RunJob:
    return RunJob(key=order.key)


@chain.step("second", ledger, after=["first"])
def second(order: ChainInput, first: RunResult) -> LedgerJob:
    fail = order.second if order.second in ("flag", "transient") else "none"
    return LedgerJob(key=f"{order.key}:second", fail=fail, fail_times=1)  # type: ignore[arg-type]  # checked above


class FanInput(BaseModel):
    key: str
    n: int = Field(ge=1, le=20_000)
    sleep_s: float = 0.0
    #: "release": each item waits for `test:release:<key>` in the ledger.
    ends: str = "sleep"


fan = Flow("test_fan", FanInput)


@fan.step("split", run, each=True)
def split(order: FanInput) -> list[RunJob]:
    ends = "release" if order.ends == "release" else "sleep"
    return [RunJob(key=order.key, sleep_s=order.sleep_s, ends=ends) for _ in range(order.n)]


@fan.step("join", ledger, after=["split"])
def join(order: FanInput, split: list[RunResult]) -> LedgerJob:
    return LedgerJob(key=f"{order.key}:join:{len(split)}")


class DiamondInput(BaseModel):
    key: str


diamond = Flow("test_diamond", DiamondInput)


@diamond.step("top", run)
def top(order: DiamondInput) -> RunJob:
    return RunJob(key=order.key)


@diamond.step("left", ledger, after=["top"])
def left(order: DiamondInput, top: RunResult) -> LedgerJob:
    return LedgerJob(key=f"{order.key}:left")


@diamond.step("right", ledger, after=["top"])
def right(order: DiamondInput, top: RunResult) -> LedgerJob:
    return LedgerJob(key=f"{order.key}:right")


@diamond.step("bottom", ledger, after=["left", "right"])
def bottom(order: DiamondInput, left: LedgerResult, right: LedgerResult) -> LedgerJob:
    return LedgerJob(key=f"{order.key}:bottom:{left.key}+{right.key}")
