"""The plugin against the installed SGLang 0.5.23 (``pip install --no-deps sglang==0.5.23``): its plugin loader
imports without third-party packages, SGLang's real ``load_plugins()`` discovers and runs our entry point and
honours ``SGLANG_PLUGINS``, every hook target is resolved statically against SGLang's source files, and anything
wrong stops the process (``SystemExit``) instead of serving without recording."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from helpers.sglang import json_tail, run_child, sglang_installed
from tracerl.sglang import targets

pytestmark = pytest.mark.skipif(not sglang_installed(), reason="SGLang is not installed (python3 -m pip install "
                                                                "--no-deps sglang==0.5.23)")

LOAD = """
import json, logging
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print(json.dumps({"hooks": sorted(HookRegistry._hooks)}))
"""


def test_plugin_loader_imports_without_third_party_packages():
    proc = run_child("""
import json, sys
before = set(sys.modules)
import sglang.srt.plugins
new = sorted(m.split(".")[0] for m in set(sys.modules) - before)
print(json.dumps({"third_party": sorted({m for m in new if m not in sys.stdlib_module_names and m != "sglang"}),
                  "sglang_init_ran": hasattr(sys.modules["sglang"], "Runtime")}))
""")
    assert proc.returncode == 0, proc.stderr
    out = json_tail(proc)
    assert out == {"third_party": [], "sglang_init_ran": False}


def test_entry_point_is_in_the_installed_metadata():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("tracerl") == "tracerl.sglang.plugin:register", "run: python3 -m pip install --no-deps -e ."


def test_unconfigured_plugin_runs_logs_one_line_and_registers_nothing():
    proc = run_child(LOAD)
    assert proc.returncode == 0, proc.stderr
    assert "Executed general plugin: tracerl" in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tracerl.sglang")]
    assert len(lines) == 1 and "not configured" in lines[0], proc.stderr
    assert json_tail(proc)["hooks"] == []


def test_sglang_plugins_whitelist_is_honoured(tmp_path):
    # configured with a store that does not exist: run, it would stop the process at its first check
    proc = run_child(LOAD, {"SGLANG_PLUGINS": "someone_else", "TRACERL_SGLANG_STORE": str(tmp_path / "nothing"),
                            "TRACERL_SGLANG_STORAGE_OPTIONS": "not json"})
    assert proc.returncode == 0, proc.stderr
    assert "Skipping plugin tracerl (not in SGLANG_PLUGINS)" in proc.stderr
    assert json_tail(proc)["hooks"] == []


def test_misconfigured_plugin_stops_the_process(tmp_path):
    proc = run_child(LOAD, {"TRACERL_SGLANG_STORE": str(tmp_path / "s"), "TRACERL_SGLANG_STORAGE_OPTIONS": "[1]"})
    assert proc.returncode == 1
    assert "tracerl.sglang: configuration: TRACERL_SGLANG_STORAGE_OPTIONS must be a JSON object" in proc.stderr
    bad_site = run_child(LOAD, {"TRACERL_SGLANG_STORE": str(tmp_path / "s"),
                                "TRACERL_SGLANG_SITES": "model.layers.3.mlp.experts.down_proj.input"})
    assert bad_site.returncode == 1 and "only the MoE layers' first-GEMM input" in bad_site.stderr


def test_configured_plugin_registers_every_hook_and_a_failed_patch_stops_the_start(tmp_path):
    # On this CPU machine SGLang's MoE modules do not import (no flashinfer, ...), so apply_hooks() fails on
    # every target and only logs it; the model runner's start (our BEFORE hook on ModelRunner.__init__, called
    # here as SGLang would) must notice and stop the process.
    proc = run_child(LOAD + """
from types import SimpleNamespace
from tracerl.sglang import hooks
try:
    hooks.before_model_runner_init(None, None, 0.8, 0, 0, SimpleNamespace(), False)
except SystemExit as e:
    print(json.dumps({"exit": str(e)}))
""", {"TRACERL_SGLANG_STORE": str(tmp_path / "s")})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    import json

    assert json.loads(lines[0])["hooks"] == sorted(t.path for t in targets.HOOKS)
    assert "Failed to apply hooks to" in proc.stderr
    msg = json.loads(lines[1])["exit"]
    assert msg.startswith("tracerl.sglang: SGLang did not apply every hook")
    assert "ModelOptNvFp4FusedMoEMethod.apply" in msg


def test_every_target_resolves_statically_against_the_installed_sglang():
    assert targets.sglang_version() == targets.WRITTEN_FOR
    assert targets.check_installed() == []


def _copy_sglang(tmp_path: Path) -> Path:
    src = targets.sglang_dir()
    dst = tmp_path / "sglang"
    for t in targets.HOOKS + targets.CALLS:
        rel = Path(*t.module.split(".")[1:])
        for cand in (rel.with_suffix(".py"), rel / "__init__.py"):
            if (src / cand).is_file():
                (dst / cand).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src / cand, dst / cand)
    shutil.copytree(src / "srt" / "arg_groups" / "fields", dst / "srt" / "arg_groups" / "fields")
    return dst


def test_changed_signature_and_missing_target_are_reported(tmp_path):
    root = _copy_sglang(tmp_path)
    assert targets.check_installed(root) == []
    trt = root / "srt/layers/moe/moe_runner/flashinfer_trtllm.py"
    trt.write_text(trt.read_text().replace("def quantize_hidden_states_fp4(\n    hidden_states: torch.Tensor,",
                                           "def quantize_hidden_states_fp4(\n    x: torch.Tensor,"))
    mq = root / "srt/layers/quantization/modelopt_quant.py"
    mq.write_text(mq.read_text().replace("class ModelOptNvFp4FusedMoEMethod(", "class RenamedNvFp4MoEMethod("))
    problems = targets.check_installed(root)
    assert any("quantize_hidden_states_fp4" in p and "parameters (x, input_scale_quant)" in p for p in problems)
    assert any("ModelOptNvFp4FusedMoEMethod.apply is not defined" in p for p in problems)
    assert len(problems) == 2, problems


def test_check_applied_finds_our_hook_in_a_real_hookregistry_wrapper():
    proc = run_child("""
import json, sys, types
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from tracerl.sglang import hooks, targets
# stand-in modules at the targets' paths: apply_hooks patches them exactly as it patches SGLang's
for t in targets.HOOKS:
    parts = t.module.split(".")
    for i in range(2, len(parts) + 1):  # every package on the way (SGLang's own __init__s need its CUDA stack)
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    mod = sys.modules[t.module]
    owner, *rest = t.qualname.split(".")
    if rest:
        cls = getattr(mod, owner, None) or type(owner, (), {})
        setattr(cls, rest[0], lambda *a, **k: None)
        setattr(mod, owner, cls)
    else:
        setattr(mod, owner, lambda *a, **k: None)
table = hooks.hook_table()
before = targets.check_applied(table)
skip = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
for path, fn in table.items():
    if path != skip:
        HookRegistry.register(path, fn, HookType.AROUND)
HookRegistry.apply_hooks()
print(json.dumps({"before": len(before), "after": targets.check_applied(table)}))
""")
    assert proc.returncode == 0, proc.stderr
    out = json_tail(proc)
    assert out["before"] == len(targets.HOOKS)
    assert len(out["after"]) == 1 and "Scheduler.handle_generate_request: not patched" in out["after"][0]


def test_plugin_module_imports_nothing_heavy():
    proc = run_child("""
import json, sys
import tracerl.sglang.plugin
print(json.dumps(sorted(m for m in ("torch", "numpy", "zarr", "pyarrow", "transformers") if m in sys.modules)))
""")
    assert proc.returncode == 0, proc.stderr
    assert json_tail(proc) == []
    assert sys.version_info >= (3, 11)
