"""TRACE in the trainer you already run: a hint feed and a model patcher that any PyTorch training loop can call
(verl's FSDP workers, slime/miles-style loops, torchtitan-style FSDP2 loops), importable without tracerl's own
trainer.

- `HintFeed` (`tracerl.hints.feed`): given a store, the trajectories of a step and the trainer's own packing (its
  (trajectory, token range) lists per micro-batch, THD), it yields per micro-batch, for this rank's slice (DP, CP
  zig-zag, TP), the device tensors the forward needs — hints, scales, global scales, routed experts, rollout
  log-probs, policy versions, rewards — read ahead in the background with bounded memory, in order.
- `patch_model` (`tracerl.hints.patch`): installs hint-guided FP4 fake quantization at a site plan's sites and
  routing replay at the routers of a Hugging Face-style MoE model, taking the current micro-batch's tensors from
  the feed (``with patch.micro_batch(batch):``); removable, no change to the model's code.
- Scale hints (`tracerl.hints.scalehints`): a store site of scale encoding ``lsb`` keeps one bit per block instead
  of its E4M3 scale byte; `use_store_scale_encodings(runtime, store)` makes a trainer's runtime reconstruct the bytes
  from its own activations (`patch_model` does it for a store source).
- Margin exceptions (`tracerl.hints.compact`, issue 23): a store site of hint encoding ``margin`` keeps hints and
  scales only where the trainer could round differently (`store_site`, `pack_rows` / `unpack_rows`,
  `packed_from_store`); the feed hands them out as ``FeedBatch.margin`` and `patch_model` / tracerl's trainer quantize
  such a site with `MarginSites` (scales and hints reconstructed from the forward's own activation). The same rows
  are packed and decoded on the tensors' device by `tracerl.hints.compact_device` (`pack_rows_torch`,
  `pack_marks_torch`, `unpack_rows_torch`, `unpack_sites_torch`: torch, byte for byte the numpy codec), which the
  rollout recorder and the feed use on CUDA.
- The packing and slicing they share (`tracerl.hints.packing`) and the record source that reads a trajectory's
  committed records without a log index (`tracerl.hints.source`).
"""

from tracerl.hints.compact import (MarginExceptions, PackedRows, Reconstruction, SiteCoding, choose_coding,
                                   encode_margin_exceptions, exceptions_from_marks, fake_quantize_compact, margin_stats,
                                   pack_rows, packed_from_store, reconstruct, store_rows, store_site, unpack_rows)
from tracerl.hints.compact_device import (pack_marks_on_device, pack_marks_torch, pack_rows_torch, unpack_rows_torch,
                                          unpack_sites_torch)
from tracerl.hints.feed import FeedBatch, HintFeed
from tracerl.hints.packing import (MicroBatch, PackedHints, Segment, concat_margin_rows, cp_shard, cp_zigzag_ranges,
                                   dp_shard, pack_micro_batches, read_packed, tp_feature_range)
from tracerl.hints.patch import MarginSites, Patch, decode_margin, patch_model
from tracerl.hints.scalehints import (fake_quantize_scale_hints, pack_scale_lsb, reconstruct_scales, unpack_scale_lsb,
                                      use_store_scale_encodings)
from tracerl.hints.source import BackgroundReads, ReaderProcess, RecordSource, packed_nbytes, read_ahead

__all__ = [
    "MarginExceptions", "Reconstruction", "encode_margin_exceptions", "fake_quantize_compact", "reconstruct",
    "SiteCoding", "PackedRows", "choose_coding", "exceptions_from_marks", "margin_stats", "pack_rows", "unpack_rows",
    "store_site", "store_rows", "packed_from_store",
    "pack_rows_torch", "pack_marks_torch", "pack_marks_on_device", "unpack_rows_torch", "unpack_sites_torch",
    "FeedBatch", "HintFeed",
    "MicroBatch", "PackedHints", "Segment", "cp_shard", "cp_zigzag_ranges", "dp_shard", "pack_micro_batches",
    "read_packed", "tp_feature_range", "concat_margin_rows",
    "Patch", "patch_model", "MarginSites", "decode_margin",
    "fake_quantize_scale_hints", "pack_scale_lsb", "reconstruct_scales", "unpack_scale_lsb", "use_store_scale_encodings",
    "BackgroundReads", "ReaderProcess", "RecordSource", "packed_nbytes", "read_ahead",
]
