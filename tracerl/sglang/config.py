"""The SGLang plugin's configuration: environment variables and an optional JSON file (torch-free).

The plugin records only when a store is configured. Everything can be set by environment variables of the SGLang
server (they reach the scheduler processes, which inherit the launcher's environment) or by a JSON file named in
``TRACERL_SGLANG_CONFIG`` whose keys are the field names of `SGLangConfig`; a variable overrides the file.

| variable | field | default |
| --- | --- | --- |
| ``TRACERL_SGLANG_STORE`` | ``store``: the store's URL (local path, ``s3://...``); the store must exist | (unset: the plugin does nothing) |
| ``TRACERL_SGLANG_CONFIG`` | a JSON file with any of the fields | none |
| ``TRACERL_SGLANG_STORAGE_OPTIONS`` | ``storage_options``: JSON object for fsspec/s3fs | ``{}`` |
| ``TRACERL_SGLANG_SITES`` | ``sites``: comma-separated site names, or ``@FILE`` with a site table (``tracerl audit --target-excess``) | the store's sites |
| ``TRACERL_SGLANG_SERVER_ID`` | ``server_id``: the start of the writer ids (``<server_id>-dp<D>-tp<T>``) | ``sglang-<host>-<port>`` |
| ``TRACERL_SGLANG_COMMIT_INTERVAL_S`` | ``commit_interval_s``: a writer commits at least this often | 5.0 |
| ``TRACERL_SGLANG_COMMIT_BYTES`` | ``commit_bytes``: and whenever this much is buffered | 64 MiB |
| ``TRACERL_SGLANG_RESULTS`` | ``results``: ``task`` (reward from the store's task), ``none`` (the RL framework writes results), ``auto`` | ``auto`` |
| ``TRACERL_SGLANG_LOGPROBS`` | ``logprobs``: ``force`` (every request computes its output log-probs) or ``request`` (only those that ask) | ``force`` |
| ``TRACERL_SGLANG_DEFAULT_VERSION`` | ``default_version``: the policy version of SGLang's initial weight version ``default`` | 0 |

Site names are tracerl's (`tracerl.policy.moe_input_site`): ``model.layers.<i>.mlp.experts.input``. SGLang 0.5.23
exposes only the MoE layers' first-GEMM (w13) input; any other site is refused (`PluginConfigError`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from tracerl.sglang.errors import PluginConfigError

__all__ = ["ENV_PREFIX", "SGLangConfig", "load_config", "moe_input_layer", "parse_sites"]

ENV_PREFIX = "TRACERL_SGLANG_"
#: tracerl's name of the MoE input (SGLang's w13 input) of decoder layer i (`tracerl.policy.moe_input_site`)
MOE_INPUT_SITE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.input")
RESULTS = ("auto", "task", "none")
LOGPROBS = ("force", "request")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,150}")


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
    """What the plugin records and where (see the module docstring for the variables).

    ``sites`` None records every site the store declares (they must all be MoE-input sites); a tuple must equal
    the store's sites (a store write carries every declared site)."""

    store: str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    sites: tuple[str, ...] | None = None
    server_id: str = ""
    commit_interval_s: float = 5.0
    commit_bytes: int = 64 << 20
    results: str = "auto"
    logprobs: str = "force"
    default_version: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise PluginConfigError(f"store must be a non-empty URL string, got {self.store!r}")
        if not isinstance(self.storage_options, dict):
            raise PluginConfigError(f"storage_options must be a JSON object, got {self.storage_options!r:.80}")
        if self.sites is not None:
            for s in self.sites:
                moe_input_layer(s)
        if self.server_id and not _ID.fullmatch(self.server_id):
            raise PluginConfigError(f"server_id {self.server_id!r}: allowed are 1-151 characters of "
                                    "[A-Za-z0-9._:-] starting with a letter or digit")
        if not (isinstance(self.commit_interval_s, (int, float)) and self.commit_interval_s >= 0):
            raise PluginConfigError(f"commit_interval_s must be a number >= 0, got {self.commit_interval_s!r}")
        if isinstance(self.commit_bytes, bool) or not isinstance(self.commit_bytes, int) or self.commit_bytes < 1:
            raise PluginConfigError(f"commit_bytes must be an int >= 1, got {self.commit_bytes!r}")
        if self.results not in RESULTS:
            raise PluginConfigError(f"results must be one of {', '.join(RESULTS)}, got {self.results!r}")
        if self.logprobs not in LOGPROBS:
            raise PluginConfigError(f"logprobs must be one of {', '.join(LOGPROBS)}, got {self.logprobs!r}")
        if isinstance(self.default_version, bool) or not isinstance(self.default_version, int) \
                or self.default_version < 0:
            raise PluginConfigError(f"default_version must be an int >= 0, got {self.default_version!r}")

    def writer_id(self, *, dp_rank: int, tp_rank: int, port: int | None = None) -> str:
        """``<server_id>-dp<D>-tp<T>``: one writer per server and rank (stable across restarts of the same server,
        so its segments stay under one ``data/<writer_id>/``; a restart never duplicates, since every commit is
        checked against the log)."""
        base = self.server_id or f"sglang-{_host()}-{port if port is not None else 0}"
        return f"{base}-dp{dp_rank}-tp{tp_rank}"

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON (storage options left out: they may hold credentials)."""
        out = dataclasses.asdict(self)
        out.pop("storage_options")
        out["sites"] = None if self.sites is None else list(self.sites)
        return out


def _host() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return name[:60].lstrip("._-") or "host"


def moe_input_layer(site: str) -> int:
    """The decoder layer of an MoE-input site name; `PluginConfigError` for any other site (SGLang 0.5.23 shows
    no other FP4 input to a plugin: the second expert GEMM's input is quantized inside the fused kernel)."""
    m = MOE_INPUT_SITE.fullmatch(site) if isinstance(site, str) else None
    if m is None:
        raise PluginConfigError(
            f"site {site!r:.100} cannot be recorded from SGLang 0.5.23: only the MoE layers' first-GEMM input is "
            "visible to a plugin (sites named model.layers.<i>.mlp.experts.input); the down-projection input, "
            "attention inputs and the KV cache are quantized inside fused kernels")
    return int(m.group(1))


def parse_sites(value: str) -> tuple[str, ...]:
    """``TRACERL_SGLANG_SITES``: ``a,b,c`` or ``@FILE`` with a site table (``{"sites": [{"name", "width"}], ...}``,
    what ``tracerl audit --target-excess`` prints)."""
    if value.startswith("@"):
        path = value[1:]
        try:
            with open(path, encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, ValueError) as e:
            raise PluginConfigError(f"{ENV_PREFIX}SITES={value!r}: cannot read the site table: {e}") from None
        rows = table.get("sites") if isinstance(table, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str)
                                                 for r in rows):
            raise PluginConfigError(f"{path}: a site table is {{\"sites\": [{{\"name\", \"width\"}}, ...], ...}}")
        names = [r["name"] for r in rows]
    else:
        names = [s.strip() for s in value.split(",") if s.strip()]
    if not names:
        raise PluginConfigError(f"{ENV_PREFIX}SITES={value!r:.100} names no site")
    return tuple(names)


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise PluginConfigError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise PluginConfigError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


_NUMBERS = {"commit_interval_s": float, "commit_bytes": int, "default_version": int}


def load_config(environ: Mapping[str, str] | None = None) -> SGLangConfig | None:
    """The configuration from ``environ`` (default ``os.environ``) and the file it names; None when neither
    ``TRACERL_SGLANG_STORE`` nor ``TRACERL_SGLANG_CONFIG`` is set (the plugin then does nothing).

    Raises:
        PluginConfigError: an unreadable file, unknown keys, values of the wrong type or out of range, a site
            SGLang cannot show, or a config without a store.
    """
    env = os.environ if environ is None else environ
    if not env.get(f"{ENV_PREFIX}STORE") and not env.get(f"{ENV_PREFIX}CONFIG"):
        return None
    fields: dict[str, Any] = {}
    path = env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                fields = _json_object(f.read(), f"{ENV_PREFIX}CONFIG file {path}")
        except OSError as e:
            raise PluginConfigError(f"{ENV_PREFIX}CONFIG={path!r}: cannot read it: {e}") from None
        if isinstance(fields.get("sites"), list):
            fields["sites"] = tuple(fields["sites"])
    known = {f.name for f in dataclasses.fields(SGLangConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PluginConfigError(f"{path}: unknown keys {unknown}; known: {', '.join(sorted(known))}")
    for name in known:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        if name == "storage_options":
            fields[name] = _json_object(raw, f"{ENV_PREFIX}STORAGE_OPTIONS")
        elif name == "sites":
            fields[name] = parse_sites(raw)
        elif name in _NUMBERS:
            try:
                fields[name] = _NUMBERS[name](raw)
            except ValueError:
                raise PluginConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
        else:
            fields[name] = raw
    if "store" not in fields:
        raise PluginConfigError(f"{ENV_PREFIX}CONFIG={path!r} names no store (set \"store\" there or "
                                f"{ENV_PREFIX}STORE)")
    return SGLangConfig(**fields)
