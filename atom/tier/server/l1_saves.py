"""Server side of engine-driven saves: space in the server's shared-memory L1 that the engine
writes itself, made visible to lookups only once the engine says the bytes are there.

Composed into the LMCache MP server by ``l1_module.build_server_modules`` beside
``atom.locate``. It imports lmcache and msgspec only: it runs inside the server process.

Three methods, all on LMCache's own L1 state machine (lmcache 0.5.6,
``v1/distributed/l1_manager.py``), under a writer tag of each reservation's own:

  ``atom.reserve``  for each item (one request's token range and object groups), a *staging*
                    object per object not already resident (``L1Manager.reserve_write``): its
                    offset and length in the segment, or nil for an object that is resident
                    (nothing to write). Answers the segment's identity as ``atom.locate``
                    does, so the engine proves the file it writes is this server's segment.
  ``atom.commit``   admits a reservation's staging objects (``L1Manager.finish_write``): they
                    become visible to lookups (and go to L2, and to KV events, as any store's).
  ``atom.abort``    discards them (``L1Manager.finish_write_and_delete``): never visible.

A staging object is invisible to every reader (lookups, prefetches, retrieves, ``atom.locate``)
until it is admitted, so a lookup never sees a half-written object. The tag is the
reservation's own (``atom.save/<server id>/<n>``), never the tag LMCache's own store uses:
another writer of the same key (the server's store, another engine, a prefetch from L2) stages
its own object beside ours, and the first one admitted is kept (a later admission of the same
key discards its copy). So a reservation that is never committed blocks nobody.

A reservation the engine never commits is released by this module (``reap``): at once (on
the next sweep, every ``reap_interval_s``) when its owner process is gone (the engine sends its
pid, the process's start time and the host's boot id; checked against ``/proc`` on this host),
or when its lease (``ttl_s``, which the engine asks for and the answer grants, at most
LMCache's own write TTL minus a second) runs out. An owner whose process this server cannot see
(another pid namespace) is held to the lease alone. The engine never writes into a reservation
after its lease: the rule that keeps reaped memory, which the allocator may give to another
object, from being written (see ``worker_side/local_save.py``).

Wire format (msgpack maps, both ways), version ``SAVES_VERSION``:
  reserve  {v, model_name, world_size, worker_id, ttl_s, owner: {pid, start, boot_id},
            items: [{request_id, token_ids, start, end, groups: [[object_group_id, last_n]]}]}
           -> {v, error, shm_name, shm_size, shm_dev, shm_ino, boot_id, server_id, ttl_s,
               status, items: [{ok, error, rid, objects: [[[offset, length] | nil, ...]
               per asked group]}]}
           (no items: the segment's identity and ``status`` only, the engine's probe)
  commit   {v, rids: [...]} -> {v, results: [[rid, ok, error], ...]}
  abort    {v, rids: [...]} -> {v, results: [[rid, ok, error], ...]}
``rid`` 0 with ``ok``: every object of the item is resident already (nothing was reserved).
``status``: counters (reserved, committed, aborted, reaped, open) for tests and /health.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

import msgspec
from lmcache.v1.multiprocess.ext_server_module import server_module_handler

from atom.tier.server.host import boot_id

log = logging.getLogger("atom.l1_saves")

RESERVE_METHOD = "atom.reserve"
COMMIT_METHOD = "atom.commit"
ABORT_METHOD = "atom.abort"
SAVES_VERSION = 1
DEFAULT_REAP_INTERVAL_S = 0.5


def process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process ``pid`` on this host, from
    ``/proc/<pid>/stat``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2 :].split()  # the command may hold spaces and parentheses
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


@dataclass
class Reservation:
    rid: int
    tag: str
    keys: list  # ObjectKeys staged under ``tag``
    owner_pid: int
    owner_start: int  # -1: the owner cannot be checked here (held to the lease alone)
    expires: float  # monotonic


class L1Saves:
    """The module object the server composes. ``locator``: the ``L1Locator`` (the segment's
    identity and this server's id)."""

    def __init__(self, ctx, locator, reap_interval_s: float = DEFAULT_REAP_INTERVAL_S) -> None:
        self._ctx = ctx
        self._locator = locator
        self._lock = threading.Lock()
        self._open: dict[int, Reservation] = {}
        self._rids = itertools.count(1)
        self.counts = {"reserved": 0, "committed": 0, "aborted": 0, "reaped": 0, "refused": 0}
        sm = ctx.storage_manager
        # the one L1 of a shared-memory server (lmcache puts L1 in shm only with exactly one);
        # LMCache's StorageManager stages every write under one tag of its own, so the
        # module stages through the L1 manager itself, as LMCache's prefetch does
        self._l1 = getattr(sm, "_l1_manager", None)
        self._write_ttl_s = self._l1_write_ttl()
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop,
            args=(reap_interval_s,),
            name="atom-l1-saves-reaper",
            daemon=True,
        )
        self._reaper.start()

    @property
    def version(self) -> int:
        """The version served (0: this server's L1 cannot be reached)."""
        return SAVES_VERSION if self._l1 is not None else 0

    def _l1_write_ttl(self) -> float:
        try:
            return float(self._l1.config.write_ttl_seconds)
        except AttributeError:
            return 600.0  # lmcache's default (--l1-write-ttl-seconds)

    @property
    def context(self):
        return self._ctx

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def status(self) -> dict:
        with self._lock:
            return {**self.counts, "open": len(self._open)}

    def report_status(self) -> dict:
        return {"atom_l1_saves": self.status()}

    def close(self) -> None:
        self._stop.set()

    # ---- reserve ------------------------------------------------------------------------

    @server_module_handler(RESERVE_METHOD)
    def reserve(self, payload: bytes) -> bytes:
        return msgspec.msgpack.encode(self._reserve(msgspec.msgpack.decode(payload)))

    def _reserve(self, req: dict) -> dict:
        answer = {
            "v": SAVES_VERSION,
            "error": "",
            **self._locator._segment_identity(),
            "server_id": self._locator.server_id,
            "ttl_s": 0.0,
            "status": {},
            "items": [],
        }
        if req.get("v") != SAVES_VERSION:
            answer["error"] = f"saves version {req.get('v')!r}; this module: {SAVES_VERSION}"
        elif self._l1 is None:
            answer["error"] = "this server's L1 manager cannot be reached"
        elif not answer["shm_name"]:
            answer["error"] = "the server's L1 is not in shared memory (start it with --shm-name)"
        if answer["error"] or not req.get("items"):
            answer["status"] = self.status()
            return answer
        ttl = min(max(float(req.get("ttl_s", 30.0)), 1.0), max(self._write_ttl_s - 1.0, 1.0))
        answer["ttl_s"] = ttl
        owner = req.get("owner") or {}
        pid, start = int(owner.get("pid", 0)), int(owner.get("start", -1))
        seen = process_start(pid) if pid > 0 else None
        if owner.get("boot_id") != answer["boot_id"] or seen is None or seen[1] != start:
            start = -1  # not checkable here: held to its lease
        for item in req["items"]:
            answer["items"].append(self._reserve_item(req, item, pid, start, ttl))
        answer["status"] = self.status()
        return answer

    def _reserve_item(self, req: dict, item: dict, pid: int, start: int, ttl: float) -> dict:
        from lmcache.v1.distributed.error import L1Error
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        out = {"ok": False, "error": "", "rid": 0, "objects": []}
        model, world = req["model_name"], int(req["world_size"])
        descs = self._ctx.layout_desc_registry.find_group_layout_descs(model, world)
        if descs is None:
            self._count("refused")
            out["error"] = f"no KV cache registered for {model!r} (world size {world})"
            return out
        key = IPCCacheServerKey(
            model_name=model,
            world_size=world,
            worker_id=int(req["worker_id"]),
            token_ids=tuple(item["token_ids"]),
            start=int(item["start"]),
            end=int(item["end"]),
            request_id=item["request_id"],
            num_kv_readers=1,
        )
        groups = [(int(g), int(n)) for g, n in item["groups"]]
        if not groups or key.end <= key.start or any(g not in descs for g, _ in groups):
            self._count("refused")
            out["error"] = f"nothing to reserve for groups {groups} of [{key.start}, {key.end})"
            return out
        try:  # an item LMCache cannot resolve (past its session's tokens) fails alone
            keys_per_group = self._ctx.resolve_obj_keys(key, [g for g, _ in groups])
        except Exception as exc:
            self._count("refused")
            out["error"] = f"the objects of [{key.start}, {key.end}) cannot be named: {exc}"
            return out
        rid = next(self._rids)
        tag = f"atom.save/{self._locator.server_id}/{rid}"
        staged: list = []
        try:
            for (group, last_n), keys in zip(groups, keys_per_group, strict=True):
                wanted = keys if last_n < 0 else keys[len(keys) - last_n :]
                got = self._l1.reserve_write(wanted, [False] * len(wanted), descs[group], tag=tag)
                spans = []
                for k in wanted:
                    err, obj = got[k]
                    if err == L1Error.SUCCESS and obj is not None:
                        staged.append(k)
                        offset = getattr(obj, "shm_offset", None)
                        if offset is None or offset < 0:
                            raise RuntimeError("a reserved object has no shared-memory offset")
                        spans.append([int(offset), int(obj.shm_byte_length)])
                    elif err == L1Error.KEY_NOT_WRITABLE:
                        spans.append(None)  # resident already: nothing to write
                    else:
                        raise RuntimeError(f"L1 refused the reservation: {err.name}")
                out["objects"].append(spans)
        except Exception as exc:
            if staged:
                self._l1.finish_write_and_delete(staged, tag=tag)
            self._count("refused")
            out.update(error=str(exc), objects=[])
            return out
        out["ok"] = True
        if staged:
            with self._lock:
                self._open[rid] = Reservation(rid, tag, staged, pid, start, time.monotonic() + ttl)
                self.counts["reserved"] += 1
            out["rid"] = rid
        return out

    # ---- commit, abort --------------------------------------------------------------------

    @server_module_handler(COMMIT_METHOD)
    def commit(self, payload: bytes) -> bytes:
        return msgspec.msgpack.encode(self._finish(msgspec.msgpack.decode(payload), True))

    @server_module_handler(ABORT_METHOD)
    def abort(self, payload: bytes) -> bytes:
        return msgspec.msgpack.encode(self._finish(msgspec.msgpack.decode(payload), False))

    def _finish(self, req: dict, commit: bool) -> dict:
        from lmcache.v1.distributed.error import L1Error

        answer = {"v": SAVES_VERSION, "results": []}
        if req.get("v") != SAVES_VERSION:
            answer["error"] = f"saves version {req.get('v')!r}; this module: {SAVES_VERSION}"
            return answer
        for rid in req.get("rids", []):
            with self._lock:
                res = self._open.pop(int(rid), None)
            if res is None:
                answer["results"].append([rid, False, "no such reservation (reaped or done)"])
                continue
            try:
                if commit:
                    errs = self._l1.finish_write(res.keys, tag=res.tag)
                else:
                    errs = self._l1.finish_write_and_delete(res.keys, tag=res.tag)
            except Exception as exc:  # never leave the staging objects live behind
                log.exception("atom.l1_saves: finishing reservation %d", res.rid)
                self._l1.finish_write_and_delete(res.keys, tag=res.tag)
                answer["results"].append([rid, False, f"{exc!r}"])
                continue
            bad = sorted({e.name for e in errs.values() if e != L1Error.SUCCESS})
            self._count("committed" if commit else "aborted")
            # a key whose LMCache write lock expired stays staged for LMCache's eviction
            answer["results"].append([rid, not bad, ", ".join(bad)])
        return answer

    # ---- reaping ------------------------------------------------------------------------

    def _reap_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.reap()
            except Exception:  # never let the reaper die
                log.exception("atom.l1_saves: reaping failed")

    def reap(self, now: float | None = None) -> int:
        """Discard reservations whose owner is gone or whose lease ran out; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [r for r in self._open.values() if now >= r.expires or self._owner_gone(r)]
            for r in due:
                del self._open[r.rid]
        for r in due:
            self._l1.finish_write_and_delete(r.keys, tag=r.tag)
            log.info(
                "atom.l1_saves: released reservation %d of pid %d (%d objects, never committed)",
                r.rid,
                r.owner_pid,
                len(r.keys),
            )
        self._count("reaped", len(due))
        return len(due)

    @staticmethod
    def _owner_gone(r: Reservation) -> bool:
        if r.owner_start < 0:
            return False
        seen = process_start(r.owner_pid)
        return seen is None or seen[1] != r.owner_start or seen[0] in ("Z", "X")


def own_identity() -> dict:
    """What an engine sends as ``owner``: its pid, its start time and the host's boot id."""
    seen = process_start(os.getpid())
    return {"pid": os.getpid(), "start": seen[1] if seen else -1, "boot_id": boot_id()}
