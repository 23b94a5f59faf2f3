"""Versioned Arrow schemas of the tracestore format (``FORMAT.md`` in this directory is the normative spec).

Version 2 adds trajectory results (``result``; results entries in the log, FORMAT §3.2); version 3 adds gc entries
(FORMAT §6) and the structural rules of results; version 4 adds the per-site ``scale_encoding`` (FORMAT §2.2, §2.4);
version 5 the per-site ``hint_encoding`` (margin-exception rows, FORMAT §2.5); versions 3, 4 and 5 have the same
schemas as version 2 (margin rows are handed out as ``TraceBatch.rows``, not in ``record``). Schemas:

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

#: the newest version: what this code writes where a store needs it (new stores take the lowest version that holds
#: their declaration, `tracestore.create_store`)
FORMAT_VERSION = 5
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4, 5)


_NULLABLE = "nullable"


def _schema(*columns: tuple) -> pa.Schema:
    """A schema from ``(name, type)`` columns, not nullable, and ``(name, type, "nullable")`` ones."""
    return pa.schema([pa.field(name, type_, nullable=_NULLABLE in rest) for name, type_, *rest in columns])


def log_entry_schema() -> pa.Schema:
    """Columns of a log entry (Arrow IPC file ``log/<seq>.arrow``), one row per committed record.

    A record is the token range ``[token_start, token_stop)`` of trajectory ``traj_id``; its rows in the
    entry's segment are ``[row_offset, row_offset + token_stop - token_start)``.
    """
    return _schema(("traj_id", pa.string()), ("token_start", pa.int64()), ("token_stop", pa.int64()),
                   ("row_offset", pa.int64()), ("policy_version", pa.int64()))


def record_schema() -> pa.Schema:
    """The logical record, one row per (trajectory, token position, site): ``hints`` holds width/8 bytes (bit i =
    LSB of code i, LSB first), ``scales`` width/block_size scale bytes (E4M3 / E8M0)."""
    return _schema(("traj_id", pa.string()), ("position", pa.int64()), ("site", pa.dictionary(pa.int32(), pa.string())),
                   ("hints", pa.binary()), ("scales", pa.binary()))


def token_schema() -> pa.Schema:
    """The per-token rollout trace, one row per (trajectory, token position).

    ``experts`` holds the routed expert ids of all declared MoE layers, layer-major: ``[L * top_k]``.
    """
    return _schema(("traj_id", pa.string()), ("position", pa.int64()), ("token_id", pa.int32()),
                   ("logprob", pa.float32()), ("policy_version", pa.int64()),
                   ("experts", pa.list_(pa.uint16()), _NULLABLE))


def trajectory_schema() -> pa.Schema:
    """Per-trajectory metadata derived from the committed log: ``num_tokens`` counts the committed tokens contiguous
    from position 0, ``committed_tokens`` all of them; ``first_seq`` / ``last_seq`` are the first and last log
    entries that hold the trajectory."""
    return _schema(("traj_id", pa.string()), ("num_tokens", pa.int64()), ("committed_tokens", pa.int64()),
                   ("num_records", pa.int64()), ("min_policy_version", pa.int64()),
                   ("max_policy_version", pa.int64()), ("first_seq", pa.int64()), ("last_seq", pa.int64()))


def result_schema() -> pa.Schema:
    """Trajectory results (format version 2), one row per trajectory whose result is committed, in log order.

    ``advantage`` is null when the rollout side left it to the trainer; ``extra`` is a JSON object as text;
    ``seq`` is the log entry that committed the result."""
    return _schema(("traj_id", pa.string()), ("reward", pa.float64()), ("group_id", pa.string()),
                   ("advantage", pa.float64(), _NULLABLE), ("prompt_len", pa.int64()), ("response_len", pa.int64()),
                   ("policy_version", pa.int64()), ("finish_reason", pa.string()), ("extra", pa.string()),
                   ("seq", pa.int64()))


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
