"""Server side of one-RPC tier hits: ``atom.lookup_locate`` runs LMCache's own lookup and, once
it has its answer, locates the hit, all in one call.

Composed into the LMCache MP server by ``l1_module.build_server_modules`` beside
``atom.locate``. It imports lmcache and msgspec only: it runs inside the server process.

The lookup is not re-implemented: the module calls the very handlers the server registered for
LMCache's LOOKUP and QUERY_PREFETCH_STATUS operations (lmcache 0.5.6: ``LookupModule.lookup``
and ``LookupModule.query_prefetch_status``), found among the modules the server built before
this one, with the key LMCache's ``AtomMPSchedulerAdapter`` builds (worker_id None, start 0,
``end`` the chunk-aligned length, ``num_kv_readers`` = ``readers``). So the prefix match, the
read locks (taken by the storage manager's prefetch, for this request id), the prefetch job
and the session's record of what was locked are exactly LMCache's: LMCache's own
FREE_LOOKUP_LOCKS and END_SESSION release and end them unchanged. The call runs on the
server's normal pool like LOOKUP, and the hit is LMCache's chunk count times its chunk size,
as the adapter computes it.

Without L2 LMCache serves a lookup from L1 while the handler runs, so the first call has the
answer. With an L2 the prefetch runs on LMCache's prefetch thread: the answer is then
``pending`` and the caller polls with ``op: "poll"`` (LMCache's QUERY_PREFETCH_STATUS, plus
the locate once it is done), one call per poll, as the adapter polls. A hit is located with
``L1Locator`` (the answer of ``atom.locate`` for [0, hit floored to ``grid``): every page
object and the image at its end), unless the request says ``locate: false``; with ``workers``
N (ranks without rank collapse, each keying its own objects) for every worker id of the world,
as ``atom.locate`` does: LMCache's lookup (worker None) fanned out over every worker, so the
hit counts only chunks every rank holds and every rank's objects are read-locked.

Wire format (msgpack maps, both ways), version ``LOOKUP_LOCATE_VERSION``:
  request  {v, op: "lookup"|"poll", model_name, world_size, request_id, token_ids, end,
            readers, grid, locate, workers (optional, default 1)}
  answer   {v, handled, error, pending, hit, located}
``handled`` false: nothing was looked up (another version, a server whose lookup handlers
were not found); the caller then uses LMCache's own lookup calls. ``located``: an
``atom.locate`` answer for the hit, or None (no hit, ``locate`` false, or a hit below one
``grid`` chunk).
"""

from __future__ import annotations

import msgspec
from lmcache.v1.multiprocess.ext_server_module import server_module_handler

LOOKUP_LOCATE_METHOD = "atom.lookup_locate"
LOOKUP_LOCATE_VERSION = 1
# the operations whose registered handlers this module calls (lmcache's RPC names)
LOOKUP_OPERATION, QUERY_OPERATION = "lookup", "query_prefetch_status"


def lookup_handlers(modules) -> tuple | None:
    """The (lookup, query_prefetch_status) handlers the server registered among ``modules``
    (the last module serving an operation wins, as it does when the server registers them),
    or None when either is missing."""
    from lmcache.v1.multiprocess.request_handler import iter_request_handlers

    found = {}
    for module in modules:
        for bound in iter_request_handlers(module):
            if bound.operation in (LOOKUP_OPERATION, QUERY_OPERATION):
                found[bound.operation] = bound.handler
    if LOOKUP_OPERATION not in found or QUERY_OPERATION not in found:
        return None
    return found[LOOKUP_OPERATION], found[QUERY_OPERATION]


class LookupLocator:
    """The module object the server composes. ``handlers``: ``lookup_handlers``'s answer;
    ``locator``: the ``L1Locator`` that answers ``atom.locate``."""

    def __init__(self, ctx, handlers: tuple | None, locator) -> None:
        self._ctx = ctx
        self._handlers = handlers
        self._locator = locator
        self.calls = 0
        self.pending = 0

    @property
    def version(self) -> int:
        """The version served (0: none, the lookup handlers were not found)."""
        return LOOKUP_LOCATE_VERSION if self._handlers is not None else 0

    @property
    def context(self):
        return self._ctx

    def report_status(self) -> dict:
        return {"atom_lookup_locate": {"calls": self.calls, "pending": self.pending}}

    def close(self) -> None:
        return None

    @server_module_handler(LOOKUP_LOCATE_METHOD)
    def lookup_locate(self, payload: bytes) -> bytes:
        self.calls += 1
        answer = self._serve(msgspec.msgpack.decode(payload))
        self.pending += answer["pending"]
        return msgspec.msgpack.encode(answer)

    def _serve(self, req: dict) -> dict:
        answer = {
            "v": LOOKUP_LOCATE_VERSION,
            "handled": False,
            "error": "",
            "pending": False,
            "hit": 0,
            "located": None,
        }
        if req.get("v") != LOOKUP_LOCATE_VERSION:
            answer["error"] = (
                f"lookup_locate version {req.get('v')!r}; this module: {LOOKUP_LOCATE_VERSION}"
            )
            return answer
        if self._handlers is None:
            answer["error"] = "the server's lookup handlers were not found"
            return answer
        lookup, query = self._handlers
        op = req.get("op")
        if op == "lookup":
            lookup(self._key(req), 1)  # LMCache's LOOKUP (tp_size: a legacy field, ignored)
        elif op != "poll":
            answer["error"] = f"unknown lookup_locate op {op!r}"
            return answer
        answer["handled"] = True
        found = query(req["request_id"])  # LMCache's QUERY_PREFETCH_STATUS
        if found is None:
            answer["pending"] = True
            return answer
        hit = int(found) * self._ctx.chunk_size
        answer["hit"] = hit
        end = hit // int(req["grid"]) * int(req["grid"])
        if req.get("locate") and end > 0:
            answer["located"] = self._locator.locate_request(
                {
                    "model_name": req["model_name"],
                    "world_size": req["world_size"],
                    "worker_id": 0,
                    "request_id": req["request_id"],
                    "token_ids": list(req["token_ids"][:end]),
                    "start": 0,
                    "end": end,
                    "groups": [[0, -1], [1, 1]],  # every page object, the image at the end
                    "workers": int(req.get("workers", 1)),  # without rank collapse: N
                }
            )
        return answer

    @staticmethod
    def _key(req: dict):
        """The lookup key, as ``AtomMPSchedulerAdapter.maybe_submit_lookup_request`` makes
        it (with ``readers`` read locks per object)."""
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(
            model_name=req["model_name"],
            world_size=int(req["world_size"]),
            worker_id=None,
            token_ids=tuple(req["token_ids"]),
            start=0,
            end=int(req["end"]),
            request_id=req["request_id"],
            num_kv_readers=int(req["readers"]),
        )
