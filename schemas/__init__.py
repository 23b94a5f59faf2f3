"""Versioned Arrow schemas of the tracestore format (``FORMAT.md`` in this directory is the normative spec).

Version 2 adds trajectory results (``result``; results entries in the log, FORMAT §3.2). Schemas:

* :func:`log_entry_schema` — the columns of a commit-log entry (one row per committed record).
* :func:`record_schema` — the logical record ``(trajectory, token position, site) -> (hint bits, block scales)``
  that readers hand out as Arrow.
* :func:`token_schema` — the per-token rollout trace (token id, rollout log-prob, policy version, experts).
* :func:`trajectory_schema` — per-trajectory metadata derived from the log (``Reader.trajectories_table``).
* :func:`result_schema` — trajectory results (version 2; ``Reader.results_table``).

``tracestore_v<N>.json`` holds the schemas of version N as data (``describe(N)``); a test keeps them equal.
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = (1, 2)


def log_entry_schema() -> pa.Schema:
    """Columns of a log entry (Arrow IPC file ``log/<seq>.arrow``), one row per committed record.

    A record is the token range ``[token_start, token_stop)`` of trajectory ``traj_id``; its rows in the
    entry's segment are ``[row_offset, row_offset + token_stop - token_start)``.
    """
    return pa.schema(
        [
            pa.field("traj_id", pa.string(), nullable=False),
            pa.field("token_start", pa.int64(), nullable=False),
            pa.field("token_stop", pa.int64(), nullable=False),
            pa.field("row_offset", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64(), nullable=False),
        ]
    )


def record_schema() -> pa.Schema:
    """The logical record, one row per (trajectory, token position, site)."""
    return pa.schema(
        [
            pa.field("traj_id", pa.string(), nullable=False),
            pa.field("position", pa.int64(), nullable=False),
            pa.field("site", pa.dictionary(pa.int32(), pa.string()), nullable=False),
            pa.field("hints", pa.binary(), nullable=False),  # width/8 bytes, bit i = LSB of code i, LSB first
            pa.field("scales", pa.binary(), nullable=False),  # width/block_size scale bytes (E4M3 / E8M0)
        ]
    )


def token_schema() -> pa.Schema:
    """The per-token rollout trace, one row per (trajectory, token position).

    ``experts`` holds the routed expert ids of all declared MoE layers, layer-major: ``[L * top_k]``.
    """
    return pa.schema(
        [
            pa.field("traj_id", pa.string(), nullable=False),
            pa.field("position", pa.int64(), nullable=False),
            pa.field("token_id", pa.int32(), nullable=False),
            pa.field("logprob", pa.float32(), nullable=False),
            pa.field("policy_version", pa.int64(), nullable=False),
            pa.field("experts", pa.list_(pa.uint16()), nullable=True),
        ]
    )


def trajectory_schema() -> pa.Schema:
    """Per-trajectory metadata derived from the committed log."""
    return pa.schema(
        [
            pa.field("traj_id", pa.string(), nullable=False),
            pa.field("num_tokens", pa.int64(), nullable=False),  # committed tokens contiguous from position 0
            pa.field("committed_tokens", pa.int64(), nullable=False),  # all committed tokens
            pa.field("num_records", pa.int64(), nullable=False),
            pa.field("min_policy_version", pa.int64(), nullable=False),
            pa.field("max_policy_version", pa.int64(), nullable=False),
            pa.field("first_seq", pa.int64(), nullable=False),  # first log entry that holds the trajectory
            pa.field("last_seq", pa.int64(), nullable=False),
        ]
    )


def result_schema() -> pa.Schema:
    """Trajectory results (format version 2), one row per trajectory whose result is committed, in log order.

    ``advantage`` is null when the rollout side left it to the trainer; ``extra`` is a JSON object as text;
    ``seq`` is the log entry that committed the result."""
    return pa.schema(
        [
            pa.field("traj_id", pa.string(), nullable=False),
            pa.field("reward", pa.float64(), nullable=False),
            pa.field("group_id", pa.string(), nullable=False),
            pa.field("advantage", pa.float64(), nullable=True),
            pa.field("prompt_len", pa.int64(), nullable=False),
            pa.field("response_len", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64(), nullable=False),
            pa.field("finish_reason", pa.string(), nullable=False),
            pa.field("extra", pa.string(), nullable=False),
            pa.field("seq", pa.int64(), nullable=False),
        ]
    )


SCHEMAS = {
    "log_entry": log_entry_schema,
    "record": record_schema,
    "token": token_schema,
    "trajectory": trajectory_schema,
    "result": result_schema,
}
#: the format version that introduced each schema
SINCE = {"log_entry": 1, "record": 1, "token": 1, "trajectory": 1, "result": 2}


def describe(version: int = FORMAT_VERSION) -> dict:
    """The schemas of format ``version`` as JSON-able data: ``{name: [{"name", "type", "nullable"}, ...]}`` plus
    the version."""
    return {
        "format_version": version,
        "schemas": {
            name: [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in make()]
            for name, make in SCHEMAS.items() if SINCE[name] <= version
        },
    }
