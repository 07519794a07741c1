"""The pieces of `pipeline.producer.template` that need no Redis: Celery's `argsrepr` and UUIDs, made cheaply."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery.utils.saferepr import saferepr
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.producer.template import ReprLimits, args_repr, uuid4_strings

#: JSON-mode payloads: what `model_dump(mode="json")` gives (strings, numbers, booleans, null, lists, objects).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=400),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=40,
)


@pytest.mark.parity
@settings(max_examples=150, deadline=None)
@given(payload=st.dictionaries(st.text(max_size=20), JSON, max_size=8), maxsize=st.sampled_from([1024, 200, 40]))
def test_argsrepr_is_celerys_saferepr(payload: dict[str, Any], maxsize: int) -> None:
    for levels in (3, 2, 5):
        expected = saferepr((payload,), maxsize, maxlevels=levels)
        assert args_repr(payload, ReprLimits(maxsize, levels)) == expected


def test_uuid4_strings_are_random_version_4_uuids_in_canonical_form() -> None:
    values = uuid4_strings(500)
    assert len(set(values)) == 500
    for text in values:
        parsed = uuid.UUID(text)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and str(parsed) == text
