"""Shared test helpers (modules, not tests): ``store`` (raw backend access, deterministic rows, writer child process), ``faults`` (the fault-injecting S3 proxy and randomized fault runs)."""
