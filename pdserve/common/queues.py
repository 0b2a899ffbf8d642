"""Waiting for a worker thread's queue to drain, on the queue's own condition."""

from __future__ import annotations

import queue
from typing import Any


def drained(q: queue.Queue[Any], timeout_s: float) -> bool:
    """Wait until every item put on `q` has been marked done (`task_done`); False when
    `timeout_s` passes first. Woken by the queue itself, never by polling."""
    with q.all_tasks_done:
        return q.all_tasks_done.wait_for(lambda: not q.unfinished_tasks, timeout_s)
