"""``tracerl audit``: what a store says about its rollout quantization. `run_audit` rebuilds the rollout's model,
replays its decode, recomputes the tokens in every trainer mode, attributes the gap by source and plans hint
coverage (`tracerl.audit.plan`); `render_terminal` and `write_html` show the result."""

from tracerl.audit.html import render_html, write_html
from tracerl.audit.report import render_terminal
from tracerl.audit.run import AUDIT_FORMAT, AUDITED_MODE, MODE_NAMES, TOP_KEYS, AuditConfig, run_audit

__all__ = ["render_html", "write_html", "render_terminal", "AUDIT_FORMAT", "AUDITED_MODE", "MODE_NAMES",
           "TOP_KEYS", "AuditConfig", "run_audit"]
