"""Declaring a flow: a small graph of typed tasks, checked when it is declared.

A flow has an input model and steps. Each step is one typed task (`pipeline.task.typed_task`) and a mapping: a
function, registered under the flow's and the step's names, that builds the step's payload from the flow's input and
the results of the steps it runs after. What travels on the wire is data (the flow's name and id, the step's name),
never a function::

    invoice = Flow("invoice", InvoiceOrder)

    @invoice.step("render", pdf.render)
    def render(order: InvoiceOrder) -> PdfJob: ...

    @invoice.step("email", email.send, after=["render"])
    def email(order: InvoiceOrder, render: PdfResult) -> EmailJob: ...

A mapping's first parameter is the flow's input; then one parameter per step of `after`, named as that step, holding
its result (a fan-out step's: the list of its items' results, in item order). A step declared with `each=True` is a
fan-out: its mapping returns a list of payloads, one job each, run in parallel. A step after several steps, or after a
fan-out step, is a join: it runs once, when all of them have succeeded. Steps with the same `after` run in parallel.

Checked at declaration (`FlowInvalid`): names, `after` naming steps declared before (so there are no cycles), the
mapping's parameters naming its `after` steps, and its annotations against the models: the input model first, each
parent's result model (a list of it for a fan-out parent), and the task's payload model (a list of it for a fan-out)
as the return type. A fan-out step runs after at most one step, which is not a fan-out itself: its payloads are built
where that step finishes, from the input and that one result.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from pipeline.config import example
from pipeline.task import TypedTask

I = TypeVar("I", bound=BaseModel)  # noqa: E741  # the flow's input model
F = TypeVar("F", bound=Callable[..., Any])

#: Every declared flow by name; filled as the modules declaring them are imported (`tasks.flows`).
FLOWS: dict[str, Flow[Any]] = {}
NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


class FlowInvalid(ValueError):
    """A flow definition that cannot run: raised when it is declared."""


@dataclass(frozen=True)
class Step:
    """One step of a flow: its task, the mapping that builds its payload, the steps it runs after."""

    name: str
    task: TypedTask[Any, Any]
    mapping: Callable[..., Any]
    after: tuple[str, ...]
    each: bool
    #: The steps that run after this one (filled as they are declared).
    children: list[str] = field(default_factory=list)


class Flow(Generic[I]):
    """A flow definition (see the module docstring); `start(flow, input)` runs one (`pipeline.flows.launch`)."""

    def __init__(self, name: str, input: type[I], *, description: str = "", example: dict[str, Any] | None = None):
        if not NAME.match(name):
            raise FlowInvalid(f"flow name {name!r}: lower-case letters, digits and _, starting with a letter")
        if name in FLOWS:
            raise FlowInvalid(f"flow {name!r} is declared twice")
        self.name = name
        self.input_model = input
        own_doc = input.__dict__.get("__doc__")  # the model's own docstring, not one it inherits (BaseModel's)
        self.description = description or inspect.cleandoc(own_doc or "").split("\n\n")[0]
        self._example = example
        self.steps: dict[str, Step] = {}
        FLOWS[name] = self

    @property
    def example(self) -> dict[str, Any] | None:
        """An input for trying the flow (the page and `pipeline flow start --example` offer it), its webhook URLs
        pointed at EXAMPLE_WEBHOOK_URL."""
        return example(self._example) if self._example is not None else None

    def step(
        self, name: str, task: TypedTask[Any, Any], *, after: Sequence[str] = (), each: bool = False
    ) -> Callable[[F], F]:
        """Declare step `name` running `task`, after the steps `after`, with the decorated mapping (see the module
        docstring); `each=True`: a fan-out, one job per payload the mapping returns."""

        def declare(mapping: F) -> F:
            self._add(Step(name, task, mapping, tuple(after), each))
            return mapping

        return declare

    def _add(self, step: Step) -> None:
        where = f"flow {self.name!r}, step {step.name!r}"
        if not NAME.match(step.name):
            raise FlowInvalid(f"{where}: lower-case letters, digits and _, starting with a letter")
        if step.name in self.steps:
            raise FlowInvalid(f"{where}: declared twice")
        unknown = [p for p in step.after if p not in self.steps]
        if unknown or len(set(step.after)) != len(step.after):
            raise FlowInvalid(f"{where}: `after` must name steps declared before it, once each (not {unknown})")
        if step.each and (len(step.after) > 1 or any(self.steps[p].each for p in step.after)):
            raise FlowInvalid(f"{where}: a fan-out step runs after at most one step, and not after a fan-out")
        _check_mapping(where, step, self.input_model, {p: self.steps[p] for p in step.after})
        for parent in step.after:
            self.steps[parent].children.append(step.name)
        self.steps[step.name] = step

    def parents_fan_out(self, step: Step) -> bool:
        """Whether `step` waits on a fan-out step (and so on several jobs)."""
        return any(self.steps[p].each for p in step.after)

    def joins(self, step: Step) -> bool:
        """Whether `step`'s payload is built when it starts, from stored results: it waits on several jobs."""
        return not step.each and (len(step.after) > 1 or self.parents_fan_out(step))

    def outline(self) -> str:
        """The steps in one line: `transcode (media.transcode, each), notify (webhooks.deliver) after transcode`."""
        return ", ".join(
            f"{s.name} ({s.task.name}{', each' if s.each else ''})"
            + (f" after {', '.join(s.after)}" if s.after else "")
            for s in self.steps.values()
        )

    def __repr__(self) -> str:
        return f"Flow({self.name!r}, steps={list(self.steps)})"


def _check_mapping(where: str, step: Step, input_model: type[BaseModel], parents: dict[str, Step]) -> None:
    """The mapping's parameters are (input, *parents by name), and its annotations match the models."""
    params = list(inspect.signature(step.mapping).parameters.values())
    names = [p.name for p in params[1:]]
    if not params or names != list(step.after):
        raise FlowInvalid(f"{where}: the mapping takes the flow's input, then {list(step.after)} by name (has {names})")
    try:
        hints = typing.get_type_hints(step.mapping)
    except (NameError, TypeError) as exc:  # an annotation that does not resolve: nothing to check it against
        raise FlowInvalid(f"{where}: the mapping's annotations do not resolve: {exc}") from None
    expected: dict[str, Any] = {params[0].name: input_model}
    for name, parent in parents.items():
        model = parent.task.result_model
        expected[name] = list[model] if parent.each else model  # type: ignore[valid-type]  # a runtime model
    payload = step.task.payload_model
    expected["return"] = list[payload] if step.each else payload  # type: ignore[valid-type]  # a runtime model
    for name, want in expected.items():
        have = hints.get(name)
        if have is not None and not _fits(have, want, provided=name != "return"):
            raise FlowInvalid(f"{where}: `{name}` is annotated {_show(have)}; the flow gives {_show(want)}")


def _fits(have: Any, want: Any, provided: bool) -> bool:
    """`have` (an annotation) accepts `want` (what the flow passes), or for a return type, `have` is a `want`."""
    if typing.get_origin(want) is list:
        inner = typing.get_args(have)
        return (
            typing.get_origin(have) in (list, Sequence)
            and bool(inner)
            and _fits(inner[0], typing.get_args(want)[0], provided)
        )
    if have is Any:
        return True
    if not (isinstance(have, type) and isinstance(want, type)):
        return False
    return issubclass(want, have) if provided else issubclass(have, want)


def _show(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)
