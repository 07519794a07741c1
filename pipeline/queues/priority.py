"""Job priorities: 0-9, 0 the most urgent, as Celery means it on a Redis broker; the list each level waits in.

kombu's Redis transport keeps one list per priority step (`priority_steps`, default 0, 3, 6, 9): a job of
priority p waits in the list of the highest step <= p, the queue's own key for step 0 and
`<queue>\\x06\\x16<step>` for the others, and a worker's fetch reads them step 0 first (`pipeline.delivery.fetch`,
kombu's `_brpop_start`). So 0, 1 and 2 share the most urgent list, 3-5 the next, 6-8 the next and 9 the last;
within a list, first in, first out. The mapping is kombu's (`Channel.priority`, `_q_for_pri`):
`tests/integration/test_priorities.py` checks it against kombu at test time.

A job sent without a priority gets TASK_DEFAULT_PRIORITY (3: one level below the top, so an urgent job overtakes
a backlog). Our producers (`TypedTask.enqueue`, the API, the CLI, `send_task` through the app's routes) send it;
a foreign Celery client that sets no priority and has not our routes gets kombu's default, 0: the top level.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from pipeline.constants import PRIORITY_SEPARATOR, PRIORITY_STEPS
from pipeline.errors import PriorityInvalid

#: The range Celery and kombu accept; 0 is the most urgent.
MIN_PRIORITY = 0
MAX_PRIORITY = 9


def check(value: Any) -> int:
    """`value` as a priority, or `PriorityInvalid` (not an integer, or outside 0-9). A bool is not a priority."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PriorityInvalid(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {value!r}")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise PriorityInvalid(f"priority must be from {MIN_PRIORITY} (most urgent) to {MAX_PRIORITY}, got {value}")
    return value


def level(priority: int) -> int:
    """The priority step a job of `priority` waits at (kombu's `Channel.priority`): 0, 3, 6 or 9."""
    return PRIORITY_STEPS[max(0, bisect_right(PRIORITY_STEPS, priority) - 1)]


def level_key(queue: str, step: int) -> str:
    """The Redis list of `queue` at priority step `step` (kombu's `_q_for_pri`)."""
    return queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}"


def priority_key(queue: str, priority: int) -> str:
    """The Redis list a job of `priority` on `queue` waits in."""
    return level_key(queue, level(priority))
