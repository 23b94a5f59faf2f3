"""Exceptions raised by tracerl, all in this one module. Messages say what arrived and what is allowed.

Every class derives from `TracerlError` and from the built-in type that describes it (``ValueError`` for a bad
value, ``LookupError`` for something absent, ...), so ``except ValueError`` keeps working where it did. The errors
about a published policy version's bytes, which also derive from `tracestore.IntegrityError`, are in
`tracerl.artifacts.errors` (this module imports nothing, so the command line loads it at once).
"""

from __future__ import annotations


class TracerlError(Exception):
    """Base class of tracerl's errors."""


class ConfigError(TracerlError, ValueError):
    """A model, site or run configuration that tracerl cannot use."""


class HintMismatchError(TracerlError, ValueError):
    """Hints or scales whose shape or site set does not match what the forward pass needs."""


class HintCodingError(TracerlError, ValueError):
    """Compact hints (`tracerl.hints.compact`) that do not decode as their coding says: a truncated or
    over-long row, a position past its row, stored bits or bytes whose count is not what the marks say."""


class PatchError(TracerlError, ValueError):
    """`tracerl.hints.patch_model` cannot patch this model as the site plan asks (a module missing, a width that
    differs, a site kind it cannot patch); nothing was installed."""


class ShapeMismatchError(TracerlError, ValueError):
    """Arrays that must have the same shape (or fit each other) do not: rollout and trainer log-probs, codes,
    scales or routed experts compared by `tracerl.fidelity`."""


class NotReadyError(TracerlError, RuntimeError):
    """A call before what it needs is there (the rollout worker asked to generate before a policy version is
    loaded)."""


class RecorderError(TracerlError, RuntimeError):
    """A recorder call out of order (e.g. a step for a request that was never begun)."""


class CheckpointError(TracerlError):
    """Base class of the trainer-checkpoint errors (`tracerl.artifacts.checkpoints`)."""


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


class SafetensorsFormatError(TracerlError, ValueError):
    """The bytes are not a safetensors file `tracerl.artifacts.tensorfile` can read (the message says what is
    wrong)."""


class LoopProcessError(TracerlError, RuntimeError):
    """A child process of the loop exited with an error (the message holds the end of its log)."""
