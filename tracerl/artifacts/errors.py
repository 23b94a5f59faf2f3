"""Errors of the policy versions beside a store (`tracerl.artifacts.weights`). They live apart from
`tracerl.errors` because the integrity error derives from `tracestore.IntegrityError` too, and `tracerl.errors`
imports nothing."""

from __future__ import annotations

from tracerl.errors import TracerlError
from tracestore.errors import IntegrityError

__all__ = ["WeightsError", "WeightsIntegrityError", "VersionNotFoundError", "VersionExistsError"]


class WeightsError(TracerlError):
    """Base class of the policy-version errors (`tracerl.artifacts.weights`)."""


class WeightsIntegrityError(WeightsError, IntegrityError):
    """A published version's bytes fail a check: sidecar undecodable or of another kind/format version, blob
    missing, size or checksum mismatch, or not a safetensors file."""


class VersionNotFoundError(WeightsError, LookupError):
    """No committed version with that number (or no version at all)."""


class VersionExistsError(WeightsError, FileExistsError):
    """`publish` of a version that is already committed (versions are immutable)."""
