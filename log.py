"""ember's logger, `logging.getLogger("ember")`.

Its level comes from EMBER_LOG (debug, info, warning, error, critical; or a number), read when
ember is imported; with EMBER_LOG set, records go to stderr. Without it ember adds no handler
and logs at WARNING, so an application's own logging configuration decides what is shown.
What is logged: at INFO, each load (the model, the backend, the time taken, its node count
and where the plan places its nodes).
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("ember")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


def configure_from_env() -> None:
    """Apply EMBER_LOG, if set, to the `ember` logger (an unknown value is ignored with a
    warning of its own: logging must never stop a model from loading)."""
    value = os.environ.get("EMBER_LOG", "").strip().lower()
    if not value:
        return
    level = _LEVELS.get(value)
    if level is None and value.isdigit():
        level = int(value)
    if level is None:
        logger.warning("EMBER_LOG=%r is not a level (debug, info, warning, error, critical)",
                       value)
        return
    logger.setLevel(level)
    if not any(getattr(h, "_ember", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ember %(levelname)s: %(message)s"))
        handler._ember = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
