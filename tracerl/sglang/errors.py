"""Exceptions raised by `tracerl.sglang`, all in this module. Each derives from `SGLangPluginError` (a
`tracerl.errors.TracerlError`) and from the built-in type that describes it.

SGLang logs and ignores ordinary exceptions raised by a plugin (``load_plugins`` and ``HookRegistry.apply_hooks``
catch ``Exception``), so at server start the plugin turns these into ``SystemExit`` with their message
(`tracerl.sglang.plugin.stop`): a misconfigured recorder stops the server instead of serving without recording.
"""

from __future__ import annotations

from tracerl.errors import ConfigError, TracerlError


class SGLangPluginError(TracerlError):
    """Base class of the SGLang plugin's errors."""


class PluginConfigError(SGLangPluginError, ConfigError):
    """The plugin's configuration (environment variables, config file, site table, store) is unusable."""


class TargetMismatchError(SGLangPluginError, LookupError):
    """An SGLang function or class the plugin hooks is missing, has another signature than the one the plugin was
    written for, or was not patched by ``HookRegistry.apply_hooks``."""


class UnsupportedSettingError(SGLangPluginError, ValueError):
    """An SGLang setting under which SGLang's FP4 codes are not visible to the plugin, or are made by a rule the
    hints do not cover (the message names the setting and what to change)."""


class CaptureError(SGLangPluginError, RuntimeError):
    """A forward the capture cannot take (more rows than its buffers hold, codes of an unexpected shape)."""


class QuantizerRecordError(SGLangPluginError, ValueError):
    """A quantizer record (per policy version and writer, beside the store) that is missing, undecodable, or
    disagrees with what another writer recorded for the same policy version."""
