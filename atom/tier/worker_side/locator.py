"""Where a lookup's hit sits in the server's L1: asked right after the lookup answers.

Runs on the lookup thread (the step thread already waits for that answer), so the load that
follows is a local copy with no RPC on its path. One ``atom.locate`` call to the server module
(``l1_module.py``) per hit returns the byte spans of every PAGE object of [0, hit) and of the
image object at ``hit``; the lookup's read locks keep those objects in place until the engine
frees them, after its copy completed.

Whether the server has the module is found out by a probe (``start_probe``) on a thread of
its own, with its own zmq context and client, so no lookup ever waits for it: lmcache 0.5.6
never replies to a call of a method no module serves, and the probe only learns that from its
deadline. Until the probe has its answer (``mode`` says "probing") every hit loads through the
server. A server without the module (or without its L1 in shared memory, or on another host)
then has every load go through the server (lmcache_driven), with one warning that says how to
enable engine-driven loads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import msgspec

from atom.tier.worker_side.l1_map import L1Mapping, Mappings, SegmentError, SegmentId

log = logging.getLogger("atom.offload")

LOCATE_METHOD = "atom.locate"  # the server module's method (l1_module.LOCATE_METHOD)
LOCATE_VERSION = 1
PAGES_GROUP, IMAGE_GROUP = 0, 1  # lmcache's object groups: full-attention pages, the images


@dataclass(frozen=True)
class Located:
    """A hit's objects in one server's L1: ``pages[i]`` is chunk i's (offset, length)."""

    mapping: L1Mapping
    pages: tuple[tuple[int, int], ...]
    image: tuple[int, int]
    end: int
    at: float  # monotonic time of the answer (the read locks lapse after the server's TTL)


class Locator:
    def __init__(
        self, *, url: str, zmq_context, namespace: str, world_size: int, chunk: int, mappings
    ):
        self.url, self.ctx, self.namespace = url, zmq_context, namespace
        self.world_size, self.chunk = world_size, chunk
        self.mappings: Mappings = mappings
        self._client = None  # the lookup thread's (the probe has its own)
        self.unsupported = ""  # why this server cannot serve engine-driven loads
        self.calls = 0
        self._known = threading.Event()  # a probe found out (module or not)
        self._closing = threading.Event()
        self._probe_thread: threading.Thread | None = None
        self._probe_timeout_s = 0.0

    @property
    def mode(self) -> str:
        """'probing' until a probe found out, then 'engine_driven' or 'lmcache_driven (why)'."""
        if self.unsupported:
            return f"lmcache_driven ({self.unsupported})"
        if not self._known.is_set():
            return "probing (hits load through the server until the server's module answers)"
        return "engine_driven"

    def _send(self, payload: dict, client=None):
        """Send one locate call (on the lookup thread's client, or ``client``); its future."""
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        if client is None:
            if self._client is None:
                from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

                self._client = RequestClientFactory.create(self.url, context=self.ctx)
            client = self._client
        self.calls += 1
        req = ServerModuleCallRequest(LOCATE_METHOD, msgspec.msgpack.encode(payload))
        return client.server_module_call(req)

    def _answer(self, fut, deadline: float, reset=None) -> dict:
        """A sent call's decoded answer; raises when there is none (and turns engine-driven
        loads off when the server cannot give one: no module, no shared-memory L1).
        ``reset`` drops the client the call went on (default: the lookup thread's)."""
        if not self._wait(fut, deadline):
            (reset or self._reset_client)()  # a reply that comes later must not answer another
            if self._server_answers():  # lmcache 0.5.6 never replies to an unserved method
                self._unsupported(
                    "the server answers but not atom.locate (start it with --server-module "
                    '\'{"module_path": "atom.tier.server.l1_module"}\' and --shm-name)'
                )
            raise TimeoutError("locate not answered in time")
        resp = fut.result()
        if not resp.success:
            if "unknown server module method" in resp.error:  # other modules, not atom's
                self._unsupported(
                    "the server has no atom.locate module (start it with --server-module "
                    '\'{"module_path": "atom.tier.server.l1_module"}\')'
                )
            raise RuntimeError(f"locate failed on the server: {resp.error}")
        answer = msgspec.msgpack.decode(resp.payload)
        if not answer.get("shm_name"):
            self._unsupported(answer.get("error") or "the server's L1 is not in shared memory")
            raise RuntimeError(self.unsupported)
        return answer

    def _wait(self, fut, deadline: float) -> bool:
        """Wait for ``fut`` until ``deadline``, in slices, so ``close`` ends a probe's wait."""
        while not fut.wait(min(max(deadline - time.monotonic(), 0.001), 0.1)):
            if time.monotonic() >= deadline or self._closing.is_set():
                return False
        return True

    def _server_answers(self, timeout_s: float = 0.5) -> bool:
        from atom.tier.server.lmcache_server import probe

        return probe(self.url, timeout_s)

    def _unsupported(self, why: str) -> None:
        if not self.unsupported:
            self.unsupported = why
            log.warning("engine-driven loads are off for %s: %s", self.url, why)

    def _reset_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def _request(self, lmc_id: str, tokens: list[int], start: int, end: int, groups) -> dict:
        return {
            "v": LOCATE_VERSION,
            "model_name": self.namespace,
            "world_size": self.world_size,
            "worker_id": 0,
            "request_id": lmc_id,
            "token_ids": list(tokens[:end]),
            "start": start,
            "end": end,
            "groups": groups,
        }

    def start_probe(self, timeout_s: float) -> None:
        """Ask the server, on a thread of its own, whether it serves ``atom.locate`` (and
        start mapping its segment before the first hit needs it); returns at once."""
        self._probe_timeout_s = timeout_s
        self._probe_thread = threading.Thread(
            target=self._probe, args=(timeout_s,), name="atom-locate-probe", daemon=True
        )
        self._probe_thread.start()

    def _probe(self, timeout_s: float) -> None:
        """The probe, on its own zmq context (closing the tier's never waits for it). A probe
        that learns nothing (a server that answers nothing) is sent again by the next hit."""
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        ctx = zmq.Context()
        ctx.linger = 0
        client = None
        try:
            client = RequestClientFactory.create(self.url, context=ctx)
            fut = self._send(self._request("atom-locate-probe", [], 0, 0, []), client)
            answer = self._answer(fut, time.monotonic() + timeout_s, reset=lambda: None)
            self._known.set()
            self.mappings.for_answer(SegmentId.of_answer(answer))
        except SegmentError as exc:
            self._unsupported(str(exc))
        except Exception as exc:
            log.debug("locate probe of %s: %s", self.url, exc)
        finally:
            if client is not None:
                client.close()
            ctx.destroy(linger=0)
            if self.unsupported:
                self._known.set()

    def locate_many(self, hits: list[tuple[str, list[int], int]], timeout_s: float) -> list:
        """Where each (lmc_id, tokens, hit)'s objects sit: a ``Located`` or None (then that
        load goes through the server). The calls are sent together, then collected. Until a
        probe found out, none is sent (a server without the module would hold each one to its
        deadline, and the lookup's answer with it); a probe that learnt nothing is sent again."""
        if self.unsupported:
            return [None] * len(hits)
        if not self._known.is_set():
            thread = self._probe_thread
            if thread is not None and not thread.is_alive() and not self._closing.is_set():
                self.start_probe(self._probe_timeout_s)
            return [None] * len(hits)
        groups = [[PAGES_GROUP, -1], [IMAGE_GROUP, 1]]
        sent = []
        try:
            for lmc_id, tokens, hit in hits:
                hit = hit // self.chunk * self.chunk  # as the connector floors it
                req = self._request(lmc_id, tokens, 0, hit, groups)
                sent.append((hit, self._send(req) if hit > 0 else None))
        except Exception as exc:
            log.debug("locate: %s", exc)
            self._reset_client()
            return [None] * len(hits)
        deadline = time.monotonic() + timeout_s
        return [self._collect(hit, fut, deadline) if fut else None for hit, fut in sent]

    def _collect(self, hit: int, fut, deadline: float) -> Located | None:
        try:
            answer = self._answer(fut, deadline)
            if not answer.get("found"):
                raise RuntimeError(answer.get("error") or "not found")
            mapping = self.mappings.for_answer(SegmentId.of_answer(answer))
        except SegmentError as exc:
            self._unsupported(str(exc))
            return None
        except Exception as exc:
            log.debug("locate [0, %d): %s", hit, exc)
            return None
        if mapping is None:
            return None  # being mapped: this load goes through the server
        pages, images = answer["objects"]
        if len(pages) != hit // self.chunk or len(images) != 1:
            return None
        return Located(
            mapping,
            tuple((int(o), int(n)) for o, n in pages),
            (int(images[0][0]), int(images[0][1])),
            hit,
            time.monotonic(),
        )

    def locate(self, lmc_id: str, tokens: list[int], hit: int, timeout_s: float):
        """One hit's ``Located`` or None."""
        return self.locate_many([(lmc_id, tokens, hit)], timeout_s)[0]

    def close(self) -> None:
        self._closing.set()
        if self._probe_thread is not None:
            self._probe_thread.join(2.0)  # its waits are sliced: it sees _closing at once
        self._reset_client()
