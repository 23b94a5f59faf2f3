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


class CheckpointError(TracerlError):
    """Base class of the trainer-checkpoint errors (`tracerl.checkpoint`)."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """No committed checkpoint at that location (or not the requested step)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A committed checkpoint whose bytes fail a check: manifest undecodable, of another kind or format version,
    a blob missing, of the wrong size or checksum, or not what its manifest says."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint of that step is already committed (checkpoints are immutable)."""


class FollowError(TracerlError, RuntimeError):
    """The live store cannot be followed as a GRPO trainer needs: a result without a group, more open groups than
    the bound, a trajectory whose tokens do not start at 0 or have a gap, tokens after its result."""
