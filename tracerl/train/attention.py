"""SDPA attention whose mask the trainer gives, so that a forward does not ask the device whether it is padded.

Hugging Face's SDPA path makes its mask in each forward from the 2D padding mask and first checks on the device
whether there is any padding (``padding_mask.all()``, or the packed-sequence check on the position ids without a
mask): one host sync per forward, which drains the launch queue of a host-bound trainer. The trainer knows on the
host whether its padded rows carry padding, so inside `own_sdpa_mask` the model runs an attention implementation
registered under `NAME` that calls Hugging Face's own ``sdpa_attention_forward`` with the mask the trainer made:
``None`` without padding (SDPA's causal path, as Hugging Face picks there) or `sdpa_padding_mask` (the mask
Hugging Face builds, element for element). The same SDPA call with the same mask: the same bits
(tests/tracerl/test_trainer.py). A name Hugging Face has no mask function for makes its mask creation return None
without looking at the inputs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tracerl.errors import ConfigError
from tracerl.util import swapped

__all__ = ["NAME", "own_sdpa_mask", "sdpa_hook_available", "sdpa_padding_mask"]

#: the attention implementation's name while the trainer gives the mask
NAME = "tracerl_sdpa"

_state = threading.local()
_UNSET = object()


def sdpa_padding_mask(padding: torch.Tensor) -> torch.Tensor:
    """bool [S, 1, L, L] mask of right-padded rows ``padding`` (0/1 [S, L]): key j is visible to query i of row b
    when j <= i and key j of row b is a token; what Hugging Face's ``sdpa_mask`` builds from a 2D mask that has
    padding, element for element, made without reading the device."""
    n = padding.shape[-1]
    ar = torch.arange(n, device=padding.device)
    causal = ar[None, None, None, :] <= ar[None, None, :, None]  # [1, 1, L, L]
    return causal & padding.bool()[:, None, None, :]


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any):
    mask = getattr(_state, "mask", _UNSET)
    if mask is _UNSET or _sdpa is None:
        raise ConfigError(f"attention implementation {NAME!r} runs only inside tracerl's own_sdpa_mask (a model "
                          f"whose config names it outside the trainer's forward; use 'sdpa')")
    return _sdpa(module, query, key, value, mask, **kwargs)


_sdpa = None  # Hugging Face's sdpa_attention_forward, once `sdpa_hook_available` found it


@functools.cache
def sdpa_hook_available() -> bool:
    """Whether this transformers registers attention functions and skips its mask for an unknown name (else the
    trainer leaves the mask to Hugging Face). The first call registers `NAME` with transformers' attention
    functions."""
    global _sdpa
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    _sdpa = sdpa_attention_forward
    AttentionInterface.register(NAME, _attention)
    return NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@contextlib.contextmanager
def own_sdpa_mask(model: torch.nn.Module, mask: torch.Tensor | None) -> Iterator[None]:
    """Run ``model``'s attention as SDPA with ``mask`` (bool [S, 1, L, L], or None: causal) inside the block, in
    this thread. Raises `ConfigError` when transformers offers no such hook (`sdpa_hook_available`)."""
    if not sdpa_hook_available():
        raise ConfigError("this transformers has no attention registry that skips its mask for an unknown name; "
                          "the trainer leaves the mask to Hugging Face there (sdpa_hook_available)")
    prev = getattr(_state, "mask", _UNSET)
    _state.mask = mask
    try:
        with swapped(model.config, _attn_implementation=NAME):
            yield
    finally:
        _state.mask = prev
