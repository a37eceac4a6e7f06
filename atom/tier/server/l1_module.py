"""Server side of engine-driven loads: an LMCache server module that says where objects sit.

Loaded into the LMCache MP server with ``--server-module '{"module_path":
"atom.tier.server.l1_module"}'`` (the owned server does this when loads are
engine-driven). It imports lmcache and msgspec only: it runs inside the server process.

One method, ``atom.locate``: for one request's token range [start, end) it returns, for
every chunk of each asked object group, the byte offset and length of the object in the
server's shared-memory L1 (``/dev/shm/<shm_name>``), plus the segment's name, size and the
identity of this server process. It takes no lock and frees none (it records the range's
tokens on the request's session, as every keyed call does): the caller holds the lookup's
read locks on exactly these objects (which keeps them in place) and frees them after copying.
An object that is missing (evicted, never stored, another server) makes the whole answer
``found=False``.

Across ranks without rank collapse each rank keys its own objects (worker r of a world of N),
and one lookup (worker None) locked every rank's: ``workers`` = N locates the same range for
worker ids 1..N-1 too, in the same call, and ``ranks`` carries their spans (one object of any
of them missing: ``found=False``). A module without the field answers worker ``worker_id``
only (no ``ranks``).

Wire format (msgpack maps, both ways), version ``LOCATE_VERSION``:
  request  {v, model_name, world_size, worker_id, request_id, token_ids, start, end, groups,
            workers (optional, default 1)}
           groups: [[object_group_id, last_n]] -- last_n < 0: every chunk, else the last n
  answer   {v, found, error, shm_name, shm_size, shm_dev, shm_ino, boot_id, server_id,
            lookup_locate, saves, objects: [[[offset, length], ...] per asked group],
            ranks (with workers > 1): [objects of worker w, for w in 1..workers-1]}
The segment's device and inode and the host's boot id let the engine prove that the file it
maps is this server's segment on this host (a name alone could be another server's). Every
answer also carries ``lookup_locate``: the version of ``atom.lookup_locate`` this server serves
(``lookup_locate.py``: LMCache's lookup and this locate in one call), 0 for none; a module
without the key (older) serves none. ``saves`` likewise: the version of ``atom.reserve``,
``atom.commit`` and ``atom.abort`` served (``l1_saves.py``: engine-driven saves).

The factory composes these methods; with ``"config": {"lookup_locate": false}`` in the
``--server-module`` spec it leaves out ``atom.lookup_locate`` (as an older module did), with
``"saves": false`` the saves' methods.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace

import msgspec
from lmcache.v1.multiprocess.ext_server_module import server_module_handler

from atom.tier.server.host import boot_id

LOCATE_METHOD = "atom.locate"
LOCATE_VERSION = 1


class L1Locator:
    """The module object the server composes; ``context`` is the shared server context."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        # one id per server process: an engine that sees it change knows its mapping and
        # every located offset belong to a server that is gone
        self.server_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.calls = 0
        self.misses = 0
        self.lookup_locate = 0  # the atom.lookup_locate version served beside (the factory's)
        self.saves = 0  # the atom.reserve/commit/abort version served beside (the factory's)
        self._segment: dict | None = None

    def _segment_identity(self) -> dict:
        if self._segment is None:
            info = self._ctx.shm_pool_info
            ident = {"shm_name": info["shm_name"], "shm_size": int(info["pool_size"])}
            ident.update(shm_dev=-1, shm_ino=-1, boot_id="")
            if info["shm_name"]:
                st = os.stat(os.path.join("/dev/shm", info["shm_name"]))
                ident.update(shm_dev=st.st_dev, shm_ino=st.st_ino, boot_id=boot_id())
            self._segment = ident
        return self._segment

    @property
    def context(self):
        return self._ctx

    def report_status(self) -> dict:
        return {"atom_l1_locator": {"calls": self.calls, "misses": self.misses}}

    def close(self) -> None:
        return None

    @server_module_handler(LOCATE_METHOD)
    def locate(self, payload: bytes) -> bytes:
        self.calls += 1
        answer = self._locate(msgspec.msgpack.decode(payload))
        if not answer["found"]:
            self.misses += 1
        return msgspec.msgpack.encode(answer)

    def locate_request(self, req: dict) -> dict:
        """The answer ``atom.locate`` gives ``req`` (any ``v`` in it is replaced by this
        module's), for a caller inside the server (``atom.lookup_locate``)."""
        answer = self._locate({**req, "v": LOCATE_VERSION})
        if not answer["found"]:
            self.misses += 1
        return answer

    def _locate(self, req: dict) -> dict:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        answer = {
            "v": LOCATE_VERSION,
            "found": False,
            "error": "",
            **self._segment_identity(),
            "server_id": self.server_id,
            "lookup_locate": self.lookup_locate,
            "saves": self.saves,
            "objects": [],
        }
        if req.get("v") != LOCATE_VERSION:
            answer["error"] = f"locate version {req.get('v')!r}; this module: {LOCATE_VERSION}"
            return answer
        if not answer["shm_name"]:
            answer["error"] = "the server's L1 is not in shared memory (start it with --shm-name)"
            return answer
        key = IPCCacheServerKey(
            model_name=req["model_name"],
            world_size=int(req["world_size"]),
            worker_id=int(req["worker_id"]),
            token_ids=tuple(req["token_ids"]),
            start=int(req["start"]),
            end=int(req["end"]),
            request_id=req["request_id"],
            num_kv_readers=1,
        )
        groups = [(int(g), int(n)) for g, n in req["groups"]]
        if not groups or key.end <= key.start:
            answer["found"] = True  # nothing asked: the segment's identity only
            return answer
        workers = max(1, int(req.get("workers", 1)))
        every = []  # the objects of worker_id, then of each other worker id
        for w in [key.worker_id, *(i for i in range(workers) if i != key.worker_id)]:
            objects, error = self._objects(replace(key, worker_id=w), groups)
            if error:
                answer["error"] = error if w == key.worker_id else f"worker {w}: {error}"
                return answer
            every.append(objects)
        answer["objects"] = every[0]
        if workers > 1:
            answer["ranks"] = every[1:]
        answer["found"] = True
        return answer

    def _objects(self, key, groups) -> tuple[list, str]:
        """(spans per group, "") of ``key``'s worker, or ([], why) when one is not in L1."""
        keys_per_group = self._ctx.resolve_obj_keys(key, [g for g, _ in groups])
        sm = self._ctx.storage_manager
        owners = self._ctx.get_read_owners(key.request_id)
        out = []
        for (_, last_n), keys in zip(groups, keys_per_group, strict=True):
            wanted = keys if last_n < 0 else keys[len(keys) - last_n :]
            found, objs = sm.unsafe_read(wanted, l1_owners=owners)
            if found != wanted:
                return [], f"{len(wanted) - len(found)} of {len(wanted)} objects not in L1"
            spans = []
            for obj in objs:
                offset = getattr(obj, "shm_offset", None)
                # (not obj.tensor: an image object's metadata shape is one layer's, and
                # viewing its K layers through it raises)
                if offset is None or offset < 0:
                    return [], "an object has no shared-memory offset"
                spans.append([int(offset), int(obj.shm_byte_length)])
            out.append(spans)
        return out, ""


def build_server_modules(build_context) -> list:
    """The factory ``--server-module`` names (lmcache's default factory name): ``atom.locate``;
    unless the spec's config says ``"lookup_locate": false``, ``atom.lookup_locate``; unless it
    says ``"saves": false``, ``atom.reserve``, ``atom.commit`` and ``atom.abort``
    (``l1_saves.py``; ``"reap_interval_s"`` sets how often it releases abandoned
    reservations)."""
    from atom.tier.server.l1_saves import DEFAULT_REAP_INTERVAL_S, L1Saves
    from atom.tier.server.lookup_locate import LookupLocator, lookup_handlers

    config = build_context.config
    locator = L1Locator(build_context.server_context)
    modules: list = [locator]
    if config.get("lookup_locate", True):
        handlers = lookup_handlers(build_context.modules)
        combined = LookupLocator(build_context.server_context, handlers, locator)
        locator.lookup_locate = combined.version
        modules.append(combined)
    if config.get("saves", True):
        interval = float(config.get("reap_interval_s", DEFAULT_REAP_INTERVAL_S))
        saves = L1Saves(build_context.server_context, locator, interval)
        locator.saves = saves.version
        modules.append(saves)
    return modules
