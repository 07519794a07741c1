"""The tracer's text of a result (`pipeline.compat.resultrepr`): Celery's `saferepr` text for plain data, Celery's own
function for the rest. Every expected text is Celery's `saferepr`, called here."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from celery.app import trace
from celery.utils.saferepr import saferepr

from pipeline.compat import resultrepr
from pipeline.compat.resultrepr import PLAIN_ITEMS, result_repr
from tests.support.compat import verified_as_installed

pytestmark = pytest.mark.parity

SAFE = string.ascii_letters + string.digits + " @.:-_/<>+="


def _plain(rng: random.Random, depth: int) -> Any:
    """Random plain data whose strings need no escaping (where `repr` and `saferepr` agree to the character)."""
    roll = rng.random()
    if depth <= 0 or roll < 0.45:
        return rng.choice(
            [
                lambda: "".join(rng.choice(SAFE) for _ in range(rng.randint(0, 24))),
                lambda: rng.randint(-(10**9), 10**9),
                lambda: rng.uniform(-1e6, 1e6),
                lambda: rng.choice([True, False, None]),
            ]
        )()
    if roll < 0.65:
        return [_plain(rng, depth - 1) for _ in range(rng.randint(0, 5))]
    if roll < 0.75:
        return tuple(_plain(rng, depth - 1) for _ in range(rng.randint(0, 3)))
    keys = ("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 10))) for _ in range(6))
    return {key: _plain(rng, depth - 1) for key in keys}


@pytest.mark.parametrize("seed", range(4))
def test_plain_data_reads_as_celerys_saferepr(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        value = _plain(rng, rng.randint(0, 5))
        for maxlen in (None, 1024, 40):
            assert result_repr(value, maxlen) == saferepr(value, maxlen), value


def test_a_typed_result_is_pythons_repr() -> None:
    result = {"message_id": "<a1@example.com>", "accepted": ["a@example.com"], "refused": {}, "size": 812}
    assert result_repr(result, 1024) == repr(result) == saferepr(result, 1024)


def test_strings_are_escaped_as_python_escapes_them() -> None:
    value = {"note": "line one\nit's"}
    assert result_repr(value, 1024) == repr(value)
    assert saferepr(value, 1024) != repr(value)  # Celery's writes the newline as it is


class Custom:
    def __repr__(self) -> str:
        return "<custom>"


@pytest.mark.parametrize(
    "value",
    [
        {"a": {"b": {"c": {"d": 1}}}},  # deeper than saferepr's three levels: elided as {...}
        {1: "int key"},
        {"x": Custom()},
        {"s": "a" * 5000},  # longer than maxlen: truncated
        list(range(PLAIN_ITEMS + 10)),  # more items than `repr` is asked to write
        {"b": b"bytes"},
        {"f": frozenset({1})},
        type("Str", (str,), {})("a str subclass"),
    ],
)
def test_anything_else_goes_to_celerys_saferepr(value: Any) -> None:
    assert result_repr(value, 1024) == saferepr(value, 1024)


def test_an_int_python_will_not_write_goes_to_celerys_saferepr() -> None:
    value = {"n": 10**5000}  # over Python's int-to-text digit limit: repr raises
    try:
        expected = saferepr(value, 1024)
    except ValueError:
        with pytest.raises(ValueError, match="digits"):
            result_repr(value, 1024)
    else:
        assert result_repr(value, 1024) == expected


def test_a_cycle_goes_to_celerys_saferepr() -> None:
    value: list[Any] = [1]
    value.append(value)
    assert result_repr(value, 1024) == saferepr(value, 1024)


def test_install_puts_it_in_the_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "saferepr", saferepr)
    with verified_as_installed():
        resultrepr.install()
    assert trace.saferepr is result_repr
