"""The size-splitting, reconnecting Redis ("resp") L2 adapter the owned LMCache server loads as
a plugin (see the comment below for why lmcache 0.5.6's own one cannot carry images)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from atom.tier.server.l2 import COMMON_KEYS, reachable

log = logging.getLogger("atom.offload")

# lmcache's own Redis client, one batch per object size.
#
# lmcache 0.5.6's C++ RESP connector (lmcache_redis, connector.cpp) refuses a batch whose
# buffers differ in size: submit_batch_set completes with ok=False, "buffer size mismatch",
# after writing the keys before the first buffer of another size. LMCache's store controller
# sends one batch per store holding both object groups, and atom's image objects are K blocks
# where a page object is one: every store with an image fails at the image, so no prefix is
# ever whole in Redis. The owned server therefore gets a resp adapter as LMCache's "plugin"
# adapter type wrapping the same native client, which submits one batch per buffer size and
# completes the caller's batch when all of its parts have completed. All I/O stays in
# lmcache's client. The same wrapper reconnects after Redis restarts (lmcache's client does not).

RESP_PLUGIN = "RESPSizeSplitAdapter"


def plugin_spec(d: dict) -> dict:
    """The --l2-adapter JSON that runs a resp adapter through the size-splitting plugin."""
    params = {k: d[k] for k in ("host", "port", "num_workers", "max_capacity_gb") if k in d}
    out = {k: d[k] for k in COMMON_KEYS - {"type"} if k in d}
    out.update(type="plugin", module_path=__name__, class_name=RESP_PLUGIN, adapter_params=params)
    return out


class _SplitBySize:
    """A native connector client whose batches may mix buffer sizes, and that reconnects.

    lmcache 0.5.6's Redis client never reconnects: after Redis restarts, every operation fails
    ("socket writev failed") until the LMCache server restarts. Here a failed operation with a
    socket error marks the client broken; a pump thread, once Redis accepts a connection again
    (checked at most every ``retry_s``), builds a fresh client and retires the old one when its
    operations have completed. Completions reach the adapter through this object's own event
    fd, which stays the same across clients."""

    def __init__(self, factory, host: str, port: int, retry_s: float = 1.0):
        from lmcache.v1.platform import create_event_notifier

        self.factory, self.host, self.port, self.retry_s = factory, host, port, retry_s
        self.inner = factory()
        self._retired: list = []  # old clients with operations still pending
        self._note = create_event_notifier()
        self._lock = threading.Lock()
        self._next = 1
        self._child: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (client, id) -> parent
        self._parent: dict[int, list] = {}  # id -> [parts left, ok, errors, bools, have bools]
        self._ready: list = []
        self._broken = False
        self._tried = 0.0
        self.reconnects = 0
        self._stop = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, name="atom-resp-pump", daemon=True)
        self._pump_thread.start()

    def event_fd(self) -> int:
        return self._note.fileno()

    def _submit(self, n: int, parts: list[tuple[list[int], Any]]) -> int:
        with self._lock:
            pid, self._next = self._next, self._next + 1
            self._parent[pid] = [len(parts), True, [], [False] * n, True]
            client = self.inner
            for idx, submit in parts:
                self._child[(id(client), int(submit(client)))] = (pid, idx)
            return pid

    def _by_size(self, keys, views, op: str):
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(views):
            groups.setdefault(len(v), []).append(i)
        parts = [
            (
                idx,
                lambda c, idx=idx: getattr(c, op)([keys[i] for i in idx], [views[i] for i in idx]),
            )
            for idx in groups.values()
        ]
        return self._submit(len(keys), parts)

    def submit_batch_set(self, keys, views) -> int:
        return self._by_size(keys, views, "submit_batch_set")

    def submit_batch_get(self, keys, views) -> int:
        return self._by_size(keys, views, "submit_batch_get")

    def submit_batch_exists(self, keys) -> int:
        every = list(range(len(keys)))
        return self._submit(len(keys), [(every, lambda c: c.submit_batch_exists(keys))])

    def submit_batch_delete(self, keys) -> int:
        every = list(range(len(keys)))
        return self._submit(len(keys), [(every, lambda c: c.submit_batch_delete(keys))])

    def drain_completions(self):
        self._note.consume()
        with self._lock:
            done, self._ready = self._ready, []
        return done

    def _collect(self, client) -> None:
        """Fold one client's completions into their batches (under the lock)."""
        for fid, ok, error, bools in client.drain_completions():
            pid, idx = self._child.pop((id(client), int(fid)), (None, None))
            if pid is None:
                continue
            if not ok and client is self.inner and ("socket" in error or "connect" in error):
                self._broken = True
            p = self._parent[pid]
            p[0] -= 1
            p[1] = p[1] and bool(ok)
            if error:
                p[2].append(str(error))
            if bools is None:
                p[4] = False
            else:
                for i, b in zip(idx, bools):
                    p[3][i] = bool(b)
            if p[0] == 0:
                del self._parent[pid]
                self._ready.append((pid, p[1], "; ".join(p[2]), p[3] if p[4] else None))

    def _pump(self) -> None:
        import select

        while not self._stop.is_set():
            with self._lock:
                clients = [self.inner, *self._retired]
            poller = select.poll()
            for c in clients:
                poller.register(c.event_fd(), select.POLLIN)
            poller.poll(100)
            with self._lock:
                for c in clients:
                    self._collect(c)
                ready = bool(self._ready)
                pending = {key[0] for key in self._child}
                done = [c for c in self._retired if id(c) not in pending]
                self._retired = [c for c in self._retired if id(c) in pending]
            if ready:
                self._note.notify()
            for c in done:
                c.close()
            if self._broken and time.monotonic() - self._tried > self.retry_s:
                self._tried = time.monotonic()
                if reachable({"host": self.host, "port": self.port}):
                    fresh = self.factory()
                    with self._lock:
                        self._retired.append(self.inner)
                        self.inner, self._broken = fresh, False
                        self.reconnects += 1
                    log.warning("L2 resp %s:%d: reconnected", self.host, self.port)

    def close(self) -> None:
        self._stop.set()
        self._pump_thread.join(timeout=2)
        for c in [self.inner, *self._retired]:
            c.close()
        self._note.close()


def _resp_plugin_class():
    from lmcache.lmcache_redis import LMCacheRedisClient
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )

    class RESPSizeSplitAdapter(NativeConnectorL2Adapter):
        def __init__(self, params: dict, l1_memory_desc=None):
            host, port = params["host"], int(params["port"])

            def connect():
                return LMCacheRedisClient(
                    host,
                    port,
                    int(params.get("num_workers", 8)),
                    os.environ.get("LMCACHE_RESP_USERNAME", ""),
                    os.environ.get("LMCACHE_RESP_PASSWORD", ""),
                )

            super().__init__(
                _SplitBySize(connect, host, port),
                max_capacity_gb=float(params.get("max_capacity_gb", 0)),
                type_name="resp",
            )

    return RESPSizeSplitAdapter


def __getattr__(name: str):
    # built on first use, so that importing this module does not import lmcache
    if name == RESP_PLUGIN:
        cls = _resp_plugin_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
