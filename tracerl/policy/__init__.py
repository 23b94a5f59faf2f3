"""The policy as both ends of the loop run it: the model (tiny Hugging Face MoE builders and their module names),
its FP4 sites (`SitePlan`), the FP4 runtime that fake-quantizes them (`install_fp4` -> `FP4Runtime`; rollout
capture, trainer QAT, hint-guided rounding, routing replay), the grouped expert GEMMs, the tasks, and the policy a
loop store describes (`build_policy`).

The rollout (`tracerl.rollout`) and the trainer (`tracerl.train`) both build on this package and never on each
other.
"""

import importlib
from typing import Any

from tracerl import deprecation

# Public names -> the module that defines them, imported on first use (PEP 562): ``tracerl loop`` checks its task
# (`tracerl.policy.tasks`, numpy only) before anything loads torch and transformers.
_EXPORTS = {
    "tracerl.policy.build": ("NO_SITE", "Policy", "build_policy", "site_widths"),
    "tracerl.policy.experts": ("grouped_gemm_supported", "grouped_gemm_sync_free", "routed_experts", "slot_order"),
    "tracerl.policy.models": ("BUILDER", "TinyMoESpec", "attention_name", "build_model", "cache_kwarg",
                              "has_linear_attention", "model_metadata", "moe_blocks", "moe_layer_name"),
    "tracerl.policy.runtime": ("MODES", "FP4Linear", "FP4MoEBlock", "FP4Runtime", "check_mode", "effective_codes",
                               "fp4_kv_cache", "install_fp4"),
    "tracerl.policy.sites": ("BLOCK", "SitePlan", "SiteSpec", "kv_cache_sites", "linear_input_site", "moe_down_site",
                             "moe_input_site", "parse_layers", "plan_sites"),
    "tracerl.policy.tasks": ("BOS", "FIRST", "SEP", "TASKS", "CopyTask", "Reward", "TargetSetTask", "Task",
                             "make_task"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = frozenset(module.rsplit(".", 1)[1] for module in _EXPORTS)

__all__ = [name for names in _EXPORTS.values() for name in names]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
_moved = deprecation.forward(__name__, {
    "create_loop_store": "tracerl.loop.store",
})


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _moved(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
