"""The policy as both ends of the loop run it: the model (tiny Hugging Face MoE builders and their module names),
its FP4 sites (`SitePlan`), the FP4 runtime that fake-quantizes them (`install_fp4` -> `FP4Runtime`; rollout
capture, trainer QAT, hint-guided rounding, routing replay), the grouped expert GEMMs, the tasks, and the policy a
loop store describes (`build_policy`).

The rollout (`tracerl.rollout`) and the trainer (`tracerl.train`) both build on this package and never on each
other.
"""

from tracerl import deprecation

from tracerl.policy.build import NO_SITE, Policy, build_policy, site_widths
from tracerl.policy.experts import grouped_gemm_supported, grouped_gemm_sync_free, routed_experts, slot_order
from tracerl.policy.models import BUILDER, TinyMoESpec, attention_name, build_model, cache_kwarg, has_linear_attention
from tracerl.policy.models import model_metadata, moe_blocks, moe_layer_name
from tracerl.policy.runtime import MODES, FP4Linear, FP4MoEBlock, FP4Runtime, check_mode, effective_codes
from tracerl.policy.runtime import fp4_kv_cache, install_fp4
from tracerl.policy.sites import BLOCK, SitePlan, SiteSpec, kv_cache_sites, linear_input_site, moe_down_site
from tracerl.policy.sites import moe_input_site, parse_layers, plan_sites
from tracerl.policy.tasks import BOS, FIRST, SEP, TASKS, CopyTask, Reward, TargetSetTask, Task, make_task

__all__ = [
    "NO_SITE", "Policy", "build_policy", "site_widths",
    "grouped_gemm_supported", "grouped_gemm_sync_free", "routed_experts", "slot_order",
    "BUILDER", "TinyMoESpec", "attention_name", "build_model", "cache_kwarg", "has_linear_attention", "model_metadata",
    "moe_blocks", "moe_layer_name",
    "MODES", "FP4Linear", "FP4MoEBlock", "FP4Runtime", "check_mode", "effective_codes", "fp4_kv_cache", "install_fp4",
    "BLOCK", "SitePlan", "SiteSpec", "kv_cache_sites", "linear_input_site", "moe_down_site", "moe_input_site",
    "parse_layers", "plan_sites",
    "BOS", "FIRST", "SEP", "TASKS", "CopyTask", "Reward", "TargetSetTask", "Task", "make_task",
]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "create_loop_store": "tracerl.loop.store",
})
