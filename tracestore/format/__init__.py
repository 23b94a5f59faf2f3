"""The on-disk format (``schemas/FORMAT.md`` is normative), as codecs that mirror each other:

* ``keys`` — format name and versions (and the one version check), object keys, id/name validation, defaults;
* ``manifest`` — the manifest's value checks and the arrays every segment holds;
* ``entries`` — commit-log entries (Arrow IPC), trajectory results and checkpoints (Parquet): encode / decode / check;
* ``segment`` — segment arrays (sharded Zarr v3 with crc32c per chunk): layouts, encoding, read plans;
* ``cursor`` — snapshots and stream cursors, built and parsed in one place.

Nothing here does I/O beyond the byte-range reads a read plan hands to a storage backend.
"""
