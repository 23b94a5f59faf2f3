"""Recording from SGLang servers: an entry-point plugin (``sglang.srt.plugins``) that records, from SGLang 0.5.23's
NVFP4 MoE path, the hint bits and block scales of the MoE input (SGLang's own codes), the scale multiplier SGLang
used, the routed experts, token ids, log-probs and policy versions into a tracestore store, so that the store feeds
``tracerl train``, ``tracerl audit`` and ``tracerl replay`` like one written by the reference engine.

| module | what |
| --- | --- |
| `plugin` | the entry point ``register`` (light: imports the rest only when configured) |
| `config` | environment variables and the config file (torch-free) |
| `targets` | what the plugin hooks and calls in SGLang, and the checks of it (static and after patching) |
| `checks` | the settings it refuses, and the quantizer settings it records |
| `capture` | the graph-safe capture into static device buffers and the host cache per KV slot |
| `session` | a finished request -> records, result and quantizer record |
| `hooks` | the hook functions (SGLang's objects -> capture and session) |
| `quantizer` | the quantizer records beside the store and `global_scales`, what a trainer divides by (torch-free) |

Trainer and audit side, for a store SGLang wrote: ``tracerl.sglang.global_scales(store, version)`` gives, per hinted
site, the fp32 ``g`` whose ``fp32(1/g)`` is bit for bit the multiplier SGLang quantized that policy version with.
"""

from tracerl.sglang.config import SGLangConfig, load_config
from tracerl.sglang.plugin import register
from tracerl.sglang.quantizer import global_scale_for, global_scales, read_records

__all__ = ["SGLangConfig", "load_config", "register", "global_scales", "global_scale_for", "read_records"]
