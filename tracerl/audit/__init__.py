"""``tracerl audit``: what a store says about its rollout quantization. `run_audit` rebuilds the rollout's model,
replays its decode, recomputes the tokens in every trainer mode, attributes the gap by source and plans hint
coverage (`tracerl.audit.plan`); `render_terminal` and `write_html` show the result."""

from tracerl import deprecation

from tracerl.audit import plan
from tracerl.audit.html import render_html, write_html
from tracerl.audit.passes import DETAIL_KEYS, PassSpec
from tracerl.audit.report import render_terminal
from tracerl.audit.run import AUDIT_FORMAT, AUDITED_MODE, MODE_NAMES, TOP_KEYS, AuditConfig, run_audit

__all__ = ["plan", "DETAIL_KEYS", "PassSpec", "render_html", "write_html", "render_terminal", "AUDIT_FORMAT", "AUDITED_MODE", "MODE_NAMES",
           "TOP_KEYS", "AuditConfig", "run_audit"]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "check_metadata": "tracerl.audit.setup",
    "load_setup": "tracerl.audit.setup",
    "REQUIRED_METADATA": "tracerl.audit.setup",
    "concurrent_decode": "tracerl.audit.replay",
    "mode_passes": "tracerl.audit.passes",
    "attribution_passes": "tracerl.audit.passes",
    "hint_pass": "tracerl.audit.passes",
    "REFERENCE_BUDGET": "tracerl.audit.run",
})
