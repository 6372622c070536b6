"""ember's logger, `logging.getLogger("ember")`.

Its level comes from EMBER_LOG (debug, info, warning, error, critical; or a number), read when
ember is imported; with EMBER_LOG set, records go to stderr. Without it ember adds no handler
and logs at WARNING, so an application's own logging configuration decides what is shown.
What is logged: at INFO, each load (the model, the backend, the time taken, its node count
and where the plan places its nodes).

onnxruntime's log severities (`ember.set_default_logger_severity`, SessionOptions'
log_severity_level) set the same logger's level: 0 verbose = DEBUG, 1 info, 2 warning,
3 error, 4 fatal = CRITICAL (`set_ort_severity`).
"""
from __future__ import annotations

import logging

from ember import config

logger = logging.getLogger("ember")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


# onnxruntime's log severities, by number, as the logging module's levels
ORT_SEVERITY_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                       logging.CRITICAL)


def set_ort_severity(severity: int) -> None:
    """The `ember` logger's level from an onnxruntime severity (0 verbose ... 4 fatal); the
    caller has checked the range."""
    logger.setLevel(ORT_SEVERITY_LEVELS[severity])


def configure_from_env() -> None:
    """Apply EMBER_LOG, if set, to the `ember` logger (an unknown value is ignored with a
    warning of its own: logging must never stop a model from loading)."""
    value = (config.text("EMBER_LOG") or "").lower()
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
