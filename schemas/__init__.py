"""Versioned Arrow schemas of the tracestore format (``FORMAT.md`` in this directory is the normative spec).

Version 1 schemas:

* :func:`log_entry_schema` — the columns of a commit-log entry (one row per committed record).
* :func:`record_schema` — the logical record ``(trajectory, token position, site) -> (hint bits, block scales)``
  that readers hand out as Arrow.
* :func:`token_schema` — the per-token rollout trace (token id, rollout log-prob, policy version, experts).
* :func:`trajectory_schema` — per-trajectory metadata derived from the log (``Reader.trajectories_table``).

``tracestore_v1.json`` holds the same schemas as data (``describe()``); a test keeps them equal.
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)


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


SCHEMAS = {
    "log_entry": log_entry_schema,
    "record": record_schema,
    "token": token_schema,
    "trajectory": trajectory_schema,
}


def describe() -> dict:
    """All schemas as JSON-able data: ``{name: [{"name", "type", "nullable"}, ...]}`` plus the version."""
    return {
        "format_version": FORMAT_VERSION,
        "schemas": {
            name: [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in make()]
            for name, make in SCHEMAS.items()
        },
    }
