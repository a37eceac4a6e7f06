"""The publisher thread: turns queued block records into vLLM event batches on ZMQ.

Threads: the step thread only calls ``put`` (never blocks: a full queue drops the record and
counts it); this thread owns both sockets, coalesces what it finds queued into one
``EventBatch``, numbers it, sends ``(topic, seq, payload)`` on the PUB socket, keeps it for
replay, and answers replay requests on the ROUTER socket: a request ``[b"", start_seq]`` (8
bytes, big-endian; a DEALER socket sends it as is, a REQ socket adds the empty frame) gets
``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on, then
``[b"", seq -1, b""]``.

Records (tuples, built on the step thread, encoded here):
  ("S", hashes, parent, token_ids, medium)   blocks stored, chained from ``parent``
  ("R", hashes, medium)                      blocks removed
  ("C",)                                     every block cleared
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from atom.kv_events.config import KVEventsConfig, binds
from atom.kv_events.wire import EventBatch, event_types

log = logging.getLogger("atom.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05  # how often an idle thread looks at the replay socket
MAX_RECORDS = 4096  # records per batch at most


class Publisher:
    """Owns the queue, the sockets and the thread. ``close`` flushes what is queued (bounded)
    and closes the sockets; it is idempotent."""

    def __init__(self, cfg: KVEventsConfig, block_size: int, data_parallel_rank: int = 0):
        self.cfg, self.block_size, self.dp_rank = cfg, block_size, data_parallel_rank
        self._stored, self._removed, self._cleared = event_types(cfg.encoding == "array")
        self._q: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._seq = 0
        self.dropped = 0  # records the step thread could not queue
        self.batches = 0
        self.events = 0
        self._put = self._done = 0  # records queued / handled (flush waits for them to meet)
        self._cv = threading.Condition()
        self._closing = threading.Event()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"kv_events: cannot open {cfg.endpoint!r} / {cfg.replay_endpoint!r}: {exc} "
                "(is the port in use? pick another endpoint)"
            ) from None
        self._thread = threading.Thread(target=self._run, name="atom-kv-events", daemon=True)
        self._thread.start()

    # ---- the step thread ----------------------------------------------------------------

    def put(self, record: tuple) -> bool:
        """Queue one record; False (and counted in ``dropped``) when the queue is full."""
        try:
            self._q.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        with self._cv:
            self._put += 1
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued record has been sent; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._done < self._put:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closing.is_set():
            return
        if not self.flush(timeout_s):
            log.warning("kv_events: %d records not sent at close", self._put - self._done)
        self._closing.set()
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)  # the last batches still reach connected subscribers
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the publisher thread -------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                self._serve_replay()
            try:
                records = [self._q.get(timeout=POLL_S)]
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            while len(records) < MAX_RECORDS:
                try:
                    records.append(self._q.get_nowait())
                except queue.Empty:
                    break
            try:
                events = self._events(records)
                payload = encode(EventBatch(time.time(), events, self.dp_rank))
                seq = self._seq
                self._seq += 1
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.batches += 1
                self.events += len(events)
            except Exception:  # never let one bad batch stop the stream
                log.exception("kv_events: a batch of %d records was not sent", len(records))
            with self._cv:
                self._done += len(records)
                self._cv.notify_all()

    def _events(self, records: list[tuple]) -> list:
        """Records -> events: a store chained to the previous store's last block (same medium,
        whole blocks of tokens) extends it; consecutive removals of one medium merge."""
        out: list = []
        bs = self.block_size
        for r in records:
            last = out[-1] if out else None
            if r[0] == "S":
                _, hashes, parent, tokens, medium = r
                if (
                    isinstance(last, self._stored)
                    and last.medium == medium
                    and parent == last.block_hashes[-1]
                    and len(tokens) == len(hashes) * bs
                    and len(last.token_ids) == len(last.block_hashes) * bs
                ):
                    last.block_hashes.extend(hashes)
                    last.token_ids.extend(tokens)
                else:
                    out.append(
                        self._stored(list(hashes), parent, list(tokens), bs, None, medium, None)
                    )
            elif r[0] == "R":
                _, hashes, medium = r
                if isinstance(last, self._removed) and last.medium == medium:
                    last.block_hashes.extend(hashes)
                else:
                    out.append(self._removed(list(hashes), medium))
            else:
                out.append(self._cleared())
        return out

    def _serve_replay(self) -> None:
        sock = self._replay
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events: replay request of %d frames ignored", len(frames))
                if len(frames) >= 2:
                    sock.send_multipart((frames[0], b"", END_SEQ, b""))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", END_SEQ, b""))
