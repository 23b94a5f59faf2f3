"""What the plugin needs of SGLang 0.5.23, as data, and checks of it against the installed SGLang (torch-free).

`HOOKS` are the functions and methods the plugin hooks through SGLang's ``HookRegistry``, `CALLS` the ones it
calls, `SERVER_ARGS` the ``ServerArgs`` fields it reads: each with the parameter names it was written against.
`check_installed` reads the installed SGLang's source files (located from its package directory, parsed with
``ast``; nothing of SGLang is imported or executed) and reports every target that is missing or whose signature
differs; `check_applied` verifies, in the running server, that ``HookRegistry.apply_hooks`` really patched every
hooked target with the plugin's own hook (it only logs a target it could not patch).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["Target", "HOOKS", "CALLS", "SERVER_ARGS", "WRITTEN_FOR", "sglang_dir", "sglang_version",
           "check_installed", "check_applied", "resolve"]

#: the SGLang release the targets were read from
WRITTEN_FOR = "0.5.23"

_MR = "sglang.srt.model_executor.model_runner"
_MQ = "sglang.srt.layers.quantization.modelopt_quant"
_TRT = "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm"
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor"
_SCH = "sglang.srt.managers.scheduler"


@dataclasses.dataclass(frozen=True)
class Target:
    """One function or method of SGLang: ``module`` (dotted), ``qualname`` (``Class.method`` or ``function``), the
    hook type (``before``, ``after``, ``around``; ``call`` for one the plugin only calls), and its parameters as
    written in SGLang (positional, then keyword-only)."""

    module: str
    qualname: str
    hook: str
    params: tuple[str, ...]
    kwonly: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        """The dotted path ``HookRegistry.register`` takes."""
        return f"{self.module}.{self.qualname}"


HOOKS: tuple[Target, ...] = (
    # start: the server settings are checked, the store is opened (scheduler process, before the model loads)
    Target(_MR, "ModelRunner.__init__", "before",
           ("self", "model_config", "mem_fraction_static", "gpu_id", "nccl_port", "server_args", "is_draft_worker",
            "req_to_token_pool", "token_to_kv_pool_allocator", "memory_pool_config", "draft_model_idx",
            "draft_attention_backend", "load_group")),
    # after the KV pool exists and before CUDA graphs are captured: the capture buffers are allocated
    Target(_MR, "ModelRunner.init_routed_experts_capturer", "after", ("self",)),
    # every forward (eager or graph replay): the forward's rows and KV slots handed to SGLang's result copy
    Target(_MR, "ModelRunner.forward", "around",
           ("self", "forward_batch", "skip_attn_backend_init", "pp_proxy_tensors", "reinit_attn_backend",
            "split_forward_count")),
    # the NVFP4 MoE layer: its layer id; FP4 that a dispatcher delivered
    Target(_MQ, "ModelOptNvFp4FusedMoEMethod.apply", "around", ("self", "layer", "dispatch_output")),
    # the TRT-LLM path's own quantization of the MoE input: SGLang's codes and scales
    Target(_TRT, "quantize_hidden_states_fp4", "after", ("hidden_states", "input_scale_quant")),
    # a finished request, before its KV slots are released: gather its rows
    Target(_BRP, "SchedulerBatchResultProcessor._maybe_collect_routed_experts", "after", ("self", "req")),
    # the end of a batch's result processing: finished requests' tokens and log-probs are final: write them
    Target(_BRP, "SchedulerBatchResultProcessor.process_batch_result_prefill", "around", ("self", "batch", "result")),
    Target(_BRP, "SchedulerBatchResultProcessor.process_batch_result_decode", "around", ("self", "batch", "result")),
    # a new request: ask for its output log-probs (TRACERL_SGLANG_LOGPROBS=force)
    Target(_SCH, "Scheduler.handle_generate_request", "before", ("self", "recv_req"), ("mm_input_error",)),
)

CALLS: tuple[Target, ...] = (
    Target("sglang.srt.state_capturer.routed_experts", "get_global_experts_capturer", "call", ()),
    Target("sglang.srt.state_capturer.base", "BaseTopkCapturer.get_topk", "call",
           ("self", "req_pool_idx", "seqlen", "req_to_token_pool", "start_len")),
    Target("sglang.srt.utils.weight_versions", "compute_weight_version_spans", "call",
           ("events", "current_version", "num_output_tokens")),
    Target("sglang.srt.runtime_context", "get_serving", "call", ()),
    Target("sglang.srt.runtime_context", "get_parallel", "call", ()),
    Target("sglang.srt.plugins.hook_registry", "HookRegistry.register", "call",
           ("cls", "target", "hook", "hook_type"), ("source",)),
    Target("sglang.srt.plugins", "load_plugins", "call", ()),
)

#: ``ServerArgs`` fields the plugin reads (declared in ``sglang/srt/arg_groups/fields/*.py`` in 0.5.23)
SERVER_ARGS: tuple[str, ...] = (
    "moe_runner_backend", "moe_a2a_backend", "enable_dp_attention", "enable_torch_compile", "speculative_algorithm",
    "pp_size", "enable_return_routed_experts", "enable_pdmux", "disaggregation_mode", "chunked_prefill_size",
    "max_prefill_tokens", "max_running_requests", "port", "quantization",
)


def sglang_dir() -> Path | None:
    """The installed ``sglang`` package directory, found without importing it (None when not installed)."""
    mod = sys.modules.get("sglang")
    if mod is not None and getattr(mod, "__path__", None):
        return Path(list(mod.__path__)[0])  # imported (or set up as a bare namespace, as the tests do)
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def sglang_version() -> str | None:
    """The installed SGLang distribution's version (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _module_file(root: Path, module: str) -> Path | None:
    rel = module.split(".")[1:]  # below sglang/
    for cand in (root.joinpath(*rel).with_suffix(".py"), root.joinpath(*rel, "__init__.py")):
        if cand.is_file():
            return cand
    return None


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    body: Sequence[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        body = cls.body
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[tuple[str, ...], tuple[str, ...]]:
    a = fn.args
    return tuple(x.arg for x in [*a.posonlyargs, *a.args]), tuple(x.arg for x in a.kwonlyargs)


def _declared_fields(root: Path) -> set[str]:
    names: set[str] = set()
    for path in sorted((root / "srt" / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names.update(n.target.id for n in node.body
                             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    return names


def check_installed(root: Path | None = None, targets: Sequence[Target] = HOOKS + CALLS) -> list[str]:
    """Problems of the installed SGLang (at ``root``, default `sglang_dir`) against ``targets`` and
    `SERVER_ARGS`: one line per missing module, class, function or field and per signature that differs. Empty:
    every target is there as the plugin was written for it. Reads and parses files only."""
    root = sglang_dir() if root is None else root
    if root is None:
        return ["SGLang is not installed (no 'sglang' package on the path)"]
    problems, trees = [], {}
    for t in targets:
        path = _module_file(root, t.module)
        if path is None:
            problems.append(f"{t.path}: module {t.module} is not in {root}")
            continue
        if path not in trees:
            trees[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        fn = _find(trees[path], t.qualname)
        if fn is None:
            problems.append(f"{t.path}: {t.qualname} is not defined in {path}")
            continue
        params, kwonly = _signature(fn)
        if params != t.params or kwonly != t.kwonly:
            problems.append(f"{t.path} ({path}:{fn.lineno}): parameters ({', '.join(params)}"
                            f"{'; *, ' + ', '.join(kwonly) if kwonly else ''}), written for ({', '.join(t.params)}"
                            f"{'; *, ' + ', '.join(t.kwonly) if t.kwonly else ''})")
    declared = _declared_fields(root)
    problems += [f"ServerArgs.{f}: not declared in {root / 'srt' / 'arg_groups' / 'fields'}"
                 for f in SERVER_ARGS if f not in declared]
    return problems


def resolve(target: Target) -> object:
    """The object at ``target`` in the running process (its module must be imported: ``apply_hooks`` did)."""
    obj: object = sys.modules[target.module]
    for part in target.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _hooks_in(fn: object) -> list[object]:
    """The hooks in a chain of ``HookRegistry`` wrappers (each keeps ``__wrapped__`` and its hook in a closure)."""
    found, seen = [], set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return found


def check_applied(hooks: Mapping[str, Callable]) -> list[str]:
    """Problems of the running process's patches: for each target path in ``hooks`` whose module is imported,
    the object there must be a ``HookRegistry`` wrapper holding that hook; a target whose module is not imported
    is reported too (``apply_hooks`` imports every target it patches)."""
    problems = []
    by_path = {t.path: t for t in HOOKS}
    for path, hook in hooks.items():
        t = by_path[path]
        if t.module not in sys.modules:
            problems.append(f"{path}: module {t.module} was never imported (HookRegistry.apply_hooks failed on it; "
                            "see SGLang's log line 'Failed to apply hooks to ...')")
            continue
        try:
            obj = resolve(t)
        except AttributeError as e:
            problems.append(f"{path}: {e}")
            continue
        if not any(h is hook for h in _hooks_in(obj)):
            problems.append(f"{path}: not patched with tracerl's hook (HookRegistry.apply_hooks logged the failure)")
    return problems
