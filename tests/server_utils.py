"""Start a real `aserve` process on a free loopback port and wait until /health says ready;
give a started process a cache folder of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from aserve.quant.native import kernels_folder
from aserve.replicas import free_port, http_status


class ServerProcess:
    def __init__(
        self, args: list[str], port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"aserve-test-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def health(self) -> int:
        return http_status(self.base_url + "/health")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            if self.health() == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def serving(process: ServerProcess) -> Iterator[ServerProcess]:
    """A module fixture's body: wait until `process` is ready, hand it out, and stop it after
    the module's tests; it must exit cleanly (0), else its log is the failure message."""
    try:
        process.wait_ready()
        yield process
    finally:
        assert process.stop() == 0, process.log()


def cache_sharing_kernels(folder: Path) -> Path:
    """`folder` as an empty aserve cache whose CPU kernels are this machine's usual ones (a
    link): a process started on a cache of its own otherwise compiles them again, ~40 s of a
    2-core CI run each time. Call it before pointing $ASERVE_CACHE_DIR at `folder`."""
    kernels = kernels_folder().parent  # this machine's builds, one folder per kind
    kernels.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(kernels, target_is_directory=True)
    return folder
