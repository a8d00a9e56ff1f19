"""Retry scheduling for transient delivery failures (pure, sans-I/O).

Rules:
- ``failures`` counts the transient failures so far (>= 1).  The backoff step is
  ``schedule[min(failures - 1, len(schedule) - 1)]``: the last step repeats forever.
- Full jitter (AWS "Exponential Backoff And Jitter"): the delay is drawn uniformly from
  ``[0, step]`` and floored at ``min(min_delay, step)``.  The step is the cap; a delay never
  exceeds it.
- A message expires when ``now - created_at >= max_age``.  Expiry is judged *after* a failed
  attempt: ``next_attempt_at`` clamps the next attempt to ``created_at + max_age`` so one last
  attempt happens exactly at the deadline, and a failure at (or after) the deadline returns
  ``None`` (the recipient fails as expired).
- The clock (``now``, Unix seconds) and the ``random.Random`` are always injected.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["is_expired", "next_attempt_at", "next_delay"]


def _check_schedule(schedule: Sequence[float]) -> None:
    if not schedule:
        raise ValueError("retry schedule must contain at least one step")
    for step in schedule:
        if not step >= 0:  # also rejects NaN
            raise ValueError(f"retry schedule steps must be >= 0 seconds, got {step!r}")


def next_delay(
    failures: int,
    schedule: Sequence[float],
    rng: random.Random,
    min_delay: float = 1.0,
) -> float:
    """Seconds to wait after the ``failures``-th transient failure (full jitter).

    The result is always within ``[min(min_delay, step), step]``.
    """
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    if min_delay < 0:
        raise ValueError(f"min_delay must be >= 0, got {min_delay}")
    _check_schedule(schedule)
    step = float(schedule[min(failures - 1, len(schedule) - 1)])
    floor = min(min_delay, step)
    return min(step, max(floor, rng.uniform(0.0, step)))


def is_expired(now: float, created_at: float, max_age: float) -> bool:
    """True when the message is at least ``max_age`` seconds old."""
    return now - created_at >= max_age


def next_attempt_at(
    now: float,
    created_at: float,
    failures: int,
    schedule: Sequence[float],
    max_age: float,
    rng: random.Random,
    min_delay: float = 1.0,
) -> float | None:
    """When to try again after a transient failure at ``now``; ``None`` means expired.

    The next attempt is never later than ``created_at + max_age``, so the last attempt
    happens at the deadline and its failure expires the recipient.
    """
    if is_expired(now, created_at, max_age):
        return None
    delay = next_delay(failures, schedule, rng, min_delay)
    return min(now + delay, created_at + max_age)
