"""Start, health-check and stop a local LMCache MP server with the flags this layout needs.

Used by the tests, the benchmarks and ``atom.serve`` (which owns one when no URL is given).
The server runs under a small wrapper (``_CHILD``) that stops it when the process that started
it dies, even by SIGKILL, and binds LMCache's Prometheus port to the server's host instead of
0.0.0.0. What a process leaves on the host carries its pid (``/tmp/atom-lmcache-<pid>-*``, the
pool's ``/dev/shm/lmcache_kv_<pid>_<n>``), so ``remove_dead_leftovers`` can remove what dead
processes left and nothing else. The layout needs ``--null-block-id -1`` and
``--separate-object-groups`` (image ordinals are recurrent groups whose non-endpoint chunks
are null) and lmcache_driven transfers.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atom.tier.server.l2_resp import plugin_spec

log = logging.getLogger("atom.offload")

TMP_PREFIX = "atom-lmcache-"
SHM_PREFIX = "lmcache_kv_"  # lmcache's own name for a migrated CPU pool: lmcache_kv_<pid>_<n>
L1_SHM_PREFIX = "lmcache_l1_pool_atom_"  # an owned server's L1: ..._<engine pid>_<port>_<start>
L1_MODULE = '{"module_path": "atom.tier.server.l1_module"}'  # --server-module

# Run as ``python -c _CHILD <parent pid> <metrics host> <server args...>``: stop the server
# when its parent is gone (polled: a parent-death signal would follow the starting *thread*),
# and bind prometheus_client's HTTP server to the given host (lmcache passes no address).
_CHILD = """
import os, runpy, signal, sys, threading, time
parent, host = int(sys.argv[1]), sys.argv[2]
def watch():
    while os.getppid() == parent:
        time.sleep(0.25)
    os.kill(os.getpid(), signal.SIGTERM)  # lmcache turns it into KeyboardInterrupt
    time.sleep(4.0)
    os._exit(1)
threading.Thread(target=watch, name="atom-parent-watch", daemon=True).start()
import prometheus_client
_start = prometheus_client.start_http_server
def _bound(port, addr=host, *args, **kw):
    return _start(port, addr, *args, **kw)
prometheus_client.start_http_server = _bound
sys.argv = ["lmcache.v1.multiprocess.server", *sys.argv[3:]]
runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__", alter_sys=True)
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_leftovers(
    shm_dir: str | Path = "/dev/shm", tmp_dir: str | Path | None = None
) -> list[str]:
    """Remove pool segments (``lmcache_kv_<pid>_<n>``) and owned-server directories
    (``atom-lmcache-<pid>-*``) whose creating process is gone; returns what was removed.
    Entries of live processes, and names without a pid, are left alone."""
    removed = []
    segments = [
        (path, path.name[len(prefix) :].split("_", 1)[0])
        for prefix in (SHM_PREFIX, L1_SHM_PREFIX)
        for path in Path(shm_dir).glob(f"{prefix}*_*")
    ]
    for path, pid in segments:
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass
    for path in Path(tmp_dir or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = path.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and int(pid) != os.getpid():
            if not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    if removed:
        log.info("removed %d leftovers of dead processes: %s", len(removed), ", ".join(removed))
    return removed


class LMCacheServerError(RuntimeError):
    pass


_handed_out: set[int] = set()  # ports free_port returned in this process


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default if the
    range cannot be read)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port nothing on ``host`` is bound to now, for a server this process starts later.

    It is chosen below the kernel's ephemeral range: a port from that range (what binding port
    0 returns) can be taken between this call and the server's bind by the source port of any
    outgoing connection, a client's reconnects to this very port included, and a CI run lost a
    server start that way ("Address already in use"). A port is not handed out twice by one
    process. Falls back to a kernel-chosen port when no candidate binds.
    """
    lo, _ = ephemeral_ports()
    first = max(1024, lo - 12288)
    rng = random.Random()
    if lo - first >= 1024:
        for _ in range(tries):
            port = rng.randrange(first, lo)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def probe(url: str, timeout_s: float) -> bool:
    """True if an LMCache MP server answers a ``noop`` at ``url`` within ``timeout_s``."""
    import zmq
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    ctx = zmq.Context()
    ctx.linger = 0  # a request queued to a dead server must not block term()
    client = RequestClientFactory.create(url, context=ctx)
    try:
        fut = client.noop()
        return bool(fut.wait(timeout_s)) and fut.result() == "OK"
    except Exception:
        return False
    finally:
        client.close()
        ctx.destroy(linger=0)


class LMCacheServer:
    """One ``lmcache.v1.multiprocess.server`` process on this host."""

    def __init__(
        self,
        *,
        chunk_size: int,
        l1_size_gb: float,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_dir: str | Path | None = None,
        l2_adapters: tuple[dict, ...] | list[dict] = (),
        l2_store_policy: str = "default",
        l2_prefetch_policy: str = "default",
        shared_l1: bool = False,
    ):
        self.host, self.port = host, port or free_port(host)
        self._port_chosen = port is None  # ours to change while no client knows it
        # engine-driven loads: L1 in /dev/shm (a fresh name per start: a killed server leaves
        # its segment, and lmcache refuses to create an existing one) and the locate module
        self.shared_l1 = shared_l1
        self.l1_segment = ""  # the current start's /dev/shm name (lmcache adds its prefix)
        # L2 adapters under L1 (atom.tier.server.l2 validates them)
        self.l2_adapters = tuple(l2_adapters)
        self.l2_store_policy, self.l2_prefetch_policy = l2_store_policy, l2_prefetch_policy
        self.metrics_port = free_port(host)  # LMCache's Prometheus endpoint
        self.chunk_size, self.l1_size_gb = chunk_size, l1_size_gb
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        # False once another process's server took this port (``disown``): atom then never
        # stops, restarts or cleans up after the server at this URL
        self.owned = True

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"lmcache-{self.port}.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-c", _CHILD, str(os.getpid()), self.host,
            "--host", self.host, "--port", str(self.port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", f"{self.l1_size_gb:g}",
            "--eviction-policy", "LRU",
            "--null-block-id", "-1",
            "--separate-object-groups",
            "--supported-transfer-mode", "lmcache_driven",
            # Eager L1. The lazy allocator's host copies run as a synchronous cudaMemcpy on
            # the legacy stream, unordered with the server's gathers on its own stream: on a
            # GPU without lmcache.cuda_ops, a store could copy another request's bytes
            # (docs/LMCACHE_API.md §9.15). On CPU lmcache already disables lazy L1.
            "--no-l1-use-lazy",
            "--prometheus-port", str(self.metrics_port),
            *server_args(self.l2_adapters, self.l2_store_policy, self.l2_prefetch_policy),
            *(["--shm-name", self.l1_segment, "--server-module", L1_MODULE]
              if self.shared_l1 else []),
        ]  # fmt: skip

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, wait: bool = True, timeout_s: float = 120.0) -> LMCacheServer:
        """Start the server (and wait until it answers). A first start on ports this object
        chose moves to fresh ports if another process bound one first; a restart keeps its
        port, since clients reconnect to it."""
        tries = 3 if self._port_chosen and self.starts == 0 else 1
        for tries_left in reversed(range(tries)):
            try:
                return self._start(wait, timeout_s)
            except LMCacheServerError as e:
                if not tries_left or "already in use" not in str(e):
                    raise
                old = self.url
                self.port, self.metrics_port = free_port(self.host), free_port(self.host)
                log.warning("LMCache server port taken at %s; retrying at %s", old, self.url)

    def _start(self, wait: bool, timeout_s: float) -> LMCacheServer:
        if self.running:
            return self
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._unlink_l1()  # what an earlier, killed start left
        if self.shared_l1:
            self.l1_segment = f"{L1_SHM_PREFIX}{os.getpid()}_{self.port}_{self.starts}"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.starts += 1
        atexit.register(self.stop)  # an owned server never outlives the process that owns it
        log.info(
            "started LMCache server pid %d at %s (log %s)", self.proc.pid, self.url, self.log_path
        )
        if wait:
            self.wait_healthy(timeout_s)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 120.0) -> float:
        """Block until the server answers; raises with the log tail if it dies or times out."""
        t0 = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise LMCacheServerError(
                    f"LMCache server at {self.url} exited with code {self.proc.returncode}:\n"
                    f"{self.log_tail()}"
                )
            if probe(self.url, 0.5):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise LMCacheServerError(
                    f"LMCache server at {self.url} not healthy after {timeout_s:.0f} s:\n"
                    f"{self.log_tail()}"
                )

    def healthy(self, timeout_s: float = 0.5) -> bool:
        return self.running and probe(self.url, timeout_s)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        """Send a signal (tests: SIGKILL, SIGSTOP, SIGCONT)."""
        if self.proc is not None:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def disown(self) -> None:
        """Forget the server: the port now belongs to one this process did not start."""
        self.owned = False
        self.proc = None
        self.l1_segment = ""  # never unlink a segment of a server that is not ours

    def stop_process(self) -> None:
        """Kill this object's process if it is still running (a start that failed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop this object's server process (never one it did not start: ``disown``) and
        clean up what it left: its L1 segment, and the log directory if it made one."""
        if self.proc is not None and self.owned:
            if self.proc.poll() is not None:
                log.info(
                    "LMCache server pid %d at %s had exited (code %s)",
                    self.proc.pid,
                    self.url,
                    self.proc.returncode,
                )
            else:
                try:
                    os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot exit
                    self.proc.terminate()
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("LMCache server pid %d ignored SIGTERM; killing it", self.proc.pid)
                    self.proc.kill()
                    self.proc.wait()
                except ProcessLookupError:
                    pass
                log.info("stopped LMCache server at %s", self.url)
            self.proc = None
            self._unlink_l1()
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _unlink_l1(self) -> None:
        """Remove this server's L1 segment once its process is gone (a server that exits
        cleanly removes it itself; SIGKILL leaves it). Mappings of it stay valid."""
        if self.l1_segment and not self.running:
            Path("/dev/shm", self.l1_segment).unlink(missing_ok=True)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def server_args(adapters, store_policy: str, prefetch_policy: str) -> list[str]:
    """The LMCache server flags for these adapters and policies ([] without adapters)."""
    if not adapters:
        return []
    args = []
    for d in adapters:
        spec = plugin_spec(d) if d.get("type") == "resp" else d
        args += ["--l2-adapter", json.dumps(spec, sort_keys=True, separators=(",", ":"))]
    return args + ["--l2-store-policy", store_policy, "--l2-prefetch-policy", prefetch_policy]
