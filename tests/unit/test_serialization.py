"""`pipeline.compat.serialization.loads` returns what kombu's JSON decoder returns, for any text (kombu's own
`loads`, called here, gives every expected value)."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from kombu import serialization as kombu_serialization
from kombu.utils import json as kombu_json

from pipeline.compat import serialization as ours

pytestmark = pytest.mark.parity


def _value(rng: random.Random, depth: int = 0) -> Any:
    leaves: list[Any] = [
        None,
        True,
        rng.randint(-5, 5),
        rng.random(),
        "text",
        "é ✓",
        "__type__",
        datetime(2026, 12, 2, tzinfo=UTC),
        uuid.UUID(int=rng.getrandbits(128)),
        Decimal("1.5"),
        b"raw",
    ]
    if depth > 2 or rng.random() < 0.4:
        return rng.choice(leaves)
    if rng.random() < 0.5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["a", "b", "__type__", "__value__", "ü", "args"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _outcome(loads: Any, text: Any) -> tuple[Any, ...]:
    try:
        return ("value", loads(text))
    except (ValueError, TypeError, KeyError) as exc:  # kombu's own (an unknown `__type__`) must match too
        return ("error", type(exc), str(exc))


def test_loads_is_kombus_for_any_encoded_value() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        text = kombu_json.dumps(_value(rng), ensure_ascii=rng.random() < 0.5)
        expected = _outcome(kombu_json.loads, text)
        for form in (text, text.encode(), memoryview(text.encode())):
            assert _outcome(ours.loads, form) == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"__type__": "datetime", "__value__": "2026-12-02T00:00:00+00:00"}',
        '{"\\u005f_type__": "bytes", "__value__": "x"}',
        '[{"a": {"__type__": "bytes", "__value__": "x"}}]',
    ],
)
def test_typed_objects_are_decoded_as_kombu_decodes_them(text: str) -> None:
    assert ours.loads(text) == kombu_json.loads(text)
    assert json.loads(text) != ours.loads(text)  # the hook ran


def test_invalid_text_fails_as_in_kombu() -> None:
    for text in ["{", "\ufeff{}", "", "[1,]"]:
        assert _outcome(ours.loads, text) == _outcome(kombu_json.loads, text)
        assert _outcome(ours.loads, text)[0] == "error"


def test_installed_it_decodes_message_bodies_and_kombu_still_encodes() -> None:
    ours.install()
    try:
        body = kombu_json.dumps([[{"when": datetime(2026, 12, 2, tzinfo=UTC)}], {}, {}])
        assert kombu_serialization.loads(body, "application/json", "utf-8") == kombu_json.loads(body)
        assert kombu_serialization.dumps({"ok": True}, serializer="json")[2] == kombu_json.dumps({"ok": True})
    finally:
        ours.uninstall()
    assert kombu_serialization.registry._decoders["application/json"] is kombu_json.loads  # type: ignore[attr-defined]
