"""The entry point SGLang's ``load_plugins()`` runs (group ``sglang.srt.plugins``, name ``tracerl``).

It imports nothing heavy until it is configured. Unconfigured (no ``TRACERL_SGLANG_STORE`` /
``TRACERL_SGLANG_CONFIG``) it logs one line and registers nothing. Configured, it checks the configuration and the
installed SGLang's hook targets (`tracerl.sglang.targets.check_installed`, from the source files) and registers
the hooks (`tracerl.sglang.hooks.install`); whatever is wrong stops the process with one message
(``SystemExit``: SGLang logs and ignores ordinary exceptions of plugins). Whether every hook was really applied
is checked in the scheduler process when its model runner starts, after ``load_plugins()`` returned.
"""

from __future__ import annotations

import logging

from tracerl.sglang.config import load_config
from tracerl.sglang.errors import PluginConfigError

log = logging.getLogger(__name__)

__all__ = ["register"]


def register() -> None:
    """Run by ``load_plugins()`` in each SGLang process. Raises ``SystemExit`` when configured but unusable."""
    try:
        cfg = load_config()
    except PluginConfigError as e:
        raise _stop(f"configuration: {e}") from None
    if cfg is None:
        log.info("tracerl.sglang: not configured (set TRACERL_SGLANG_STORE=<store URL> to record); recording nothing")
        return
    from tracerl.sglang import targets

    problems = targets.check_installed()
    if problems:
        raise _stop(f"written for SGLang {targets.WRITTEN_FOR}, installed {targets.sglang_version()}; "
                    + "; ".join(problems))
    from tracerl.sglang import hooks

    hooks.install(cfg)
    log.info("tracerl.sglang: hooks registered for store %s (%d targets)", cfg.store, len(targets.HOOKS))


def _stop(message: str) -> SystemExit:
    log.error("tracerl.sglang: %s", message)
    return SystemExit(f"tracerl.sglang: {message}")
