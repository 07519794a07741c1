"""The job browser's cursors: opaque, tied to their queue and state, refused when forged or mangled."""

from __future__ import annotations

import pytest

from pipeline.browse.model import BadCursor, BrowseState, cursor_after, cursor_offset, decode_cursor, encode_cursor


def test_a_cursor_returns_its_position_for_its_queue_and_state_only() -> None:
    cursor = encode_cursor("email", BrowseState.SCHEDULED, [1764590000.25, "job-1"])
    assert decode_cursor(cursor, "email", BrowseState.SCHEDULED) == [1764590000.25, "job-1"]
    assert cursor_after(decode_cursor(cursor, "email", BrowseState.SCHEDULED)) == (1764590000.25, "job-1")
    with pytest.raises(BadCursor, match="next_cursor of this queue and state"):
        decode_cursor(cursor, "pdf", BrowseState.SCHEDULED)
    with pytest.raises(BadCursor):
        decode_cursor(cursor, "email", BrowseState.WAITING)
    assert decode_cursor(None, "email", BrowseState.WAITING) is None
    assert decode_cursor("", "email", BrowseState.WAITING) is None


@pytest.mark.parametrize(
    "cursor", ["not-a-cursor", "e30", "!!!", encode_cursor("default", BrowseState.WAITING, 3)[:-4]]
)
def test_garbage_is_refused(cursor: str) -> None:
    with pytest.raises(BadCursor):
        decode_cursor(cursor, "default", BrowseState.WAITING)


@pytest.mark.parametrize("position", [-1, "3", 2.5, None, [1]])
def test_an_offset_is_a_non_negative_integer(position: object) -> None:
    with pytest.raises(BadCursor):
        cursor_offset(position)
    assert cursor_offset(7) == 7


@pytest.mark.parametrize("position", [3, [1, 2], ["x", "id"], [1.0, "id", "extra"]])
def test_a_sorted_position_is_a_score_and_an_id(position: object) -> None:
    with pytest.raises(BadCursor):
        cursor_after(position)
    assert cursor_after(None) is None
