"""Run ``python -m atom.serve`` in a subprocess and talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from atom.tier.server.lmcache_server import LMCacheServer, free_port

TINY_FLAGS = [
    "--model", "v41-tiny", "--block-size", "16", "--num-blocks", "400",
    "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--device", "cpu",
    "--dtype", "float32", "--kv-dtype", "fp32", "--index-dtype", "fp32",
    "--log-interval", "1",
]  # fmt: skip


class ServeProcess:
    started: list[ServeProcess] = []  # every server a test started (killed at the end if alive)
    # where logs go: the session's pytest temporary directory (pytest keeps the last three
    # sessions' and removes older ones), set by ``serve_logs`` in tests/conftest.py (every
    # directory's tests that start a server, not only tests/serve)
    log_root: Path | None = None

    def __init__(self, *flags: str):
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="atom-serve-", dir=self.log_root)) / "serve.log"
        cmd = [sys.executable, "-m", "atom.serve", *TINY_FLAGS, "--port", str(self.port), *flags]
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        ServeProcess.started.append(self)

    def wait_ready(self, timeout_s: float = 120.0) -> dict:
        """Poll /health (each poll is a bounded HTTP call) until it answers 200."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"atom.serve exited {self.proc.returncode}:\n{self.text()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=1.0)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                with httpx.Client() as c:  # bounded wait for the port to open
                    try:
                        c.get(f"{self.url}/health", timeout=0.5)
                    except httpx.HTTPError:
                        pass
        raise AssertionError(f"atom.serve not ready in {timeout_s}s:\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"atom.serve ignored SIGTERM:\n{self.text()}") from None
        return self.proc.returncode


@pytest.fixture(autouse=True)
def no_orphan_servers():
    """A test that fails before terminating its servers must not leave them running."""
    yield
    while ServeProcess.started:
        proc = ServeProcess.started.pop().proc
        if proc.poll() is None and not _module_scoped(proc):
            proc.kill()
            proc.wait()


def _module_scoped(proc) -> bool:
    return any(s.proc is proc for s in _MODULE_SERVERS)


_MODULE_SERVERS: list[ServeProcess] = []


@pytest.fixture(scope="module")
def lmcache():
    server = LMCacheServer(chunk_size=16, l1_size_gb=0.25, shared_l1=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(lmcache):
    """One server for the module, with the tier on an external LMCache server."""
    proc = ServeProcess("--offload", "lmcache_mp", "--lmcache-url", lmcache.url)
    _MODULE_SERVERS.append(proc)
    proc.wait_ready()
    yield proc
    _MODULE_SERVERS.remove(proc)
    assert proc.terminate() == 0, proc.text()
