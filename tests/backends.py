"""Which backends the tests run on, and per-backend placement statistics for the summary."""
from __future__ import annotations

import functools
import os

from ember.errors import BackendUnavailableError
from ember.runtime.backends import BACKENDS, get_backend

HERE = os.path.dirname(os.path.abspath(__file__))

# backend -> {placement: node count} over the cases run, printed at the end of the test run
PLACEMENT: dict[str, dict[str, int]] = {}


@functools.lru_cache(maxsize=None)
def unavailable_reason(backend: str) -> str | None:
    """None if `backend` can run here, else why not (the BackendUnavailableError message)."""
    try:
        get_backend(backend)
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def present_backends() -> list[str]:
    return [b for b in BACKENDS if unavailable_reason(b) is None]


def xfail_file(backend: str) -> str:
    return os.path.join(HERE, f"xfail_{backend}.txt")


def record_placement(backend: str, session) -> None:
    counts = PLACEMENT.setdefault(backend, {})
    for where, n in session.placement_summary().items():
        counts[where] = counts.get(where, 0) + n
