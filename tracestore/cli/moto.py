"""A moto S3 server in a subprocess on 127.0.0.1 (a free port): the S3 side of the store benchmark when no endpoint
is given."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from ..errors import BenchError

__all__ = ["MotoServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A moto S3 server in a subprocess on 127.0.0.1 (a subprocess so that it does not share the benchmark's
    GIL). Context manager; ``endpoint`` is its URL."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._timeout = start_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BenchError(f"moto server exited with code {self._proc.returncode} (is moto[server] installed?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise BenchError(f"moto server did not listen on port {self.port} within {self._timeout} s")

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
