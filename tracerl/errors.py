"""Exceptions raised by tracerl. Messages say what arrived and what is allowed."""

from __future__ import annotations


class TracerlError(Exception):
    """Base class of tracerl's errors."""


class ConfigError(TracerlError, ValueError):
    """A model, site or run configuration that tracerl cannot use."""


class HintMismatchError(TracerlError, ValueError):
    """Hints or scales whose shape or site set does not match what the forward pass needs."""


class RecorderError(TracerlError, RuntimeError):
    """A recorder call out of order (e.g. a step for a request that was never begun)."""
