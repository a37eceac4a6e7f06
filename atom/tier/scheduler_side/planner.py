"""Scheduler side of the LMCache tier: lookups, load and save decisions, completions.

The connector answers; the engine scheduler decides. It writes no engine state (no
``Sequence``, no block pool, no image store): lookups return a ``TierAnswer``, and ``update``,
``start_load``, ``after_step`` and ``shutdown`` return the outcomes they produced (``Answered``,
``Loaded`` naming the blocks and image a load filled, ``LoadFailed``, and the transfers'
``Lease`` / ``Unlease``), which the engine applies. Per request it keeps one ``TierRequest``
(its phase, locks, saves and live transfers; operations.py has the phases):

  lookup    at first admission, for tokens[:n-1] (the adapter floors to the chunk grid), so a
            hit always leaves a prefill token and ends where a load can end (a stored image).
            When HBM already covers every loadable token the request is admitted at once and
            the answer only tells the saves what the tier still holds (an idle tier costs no
            step): it is asked near the first boundary the request would store (at once for
            a prefix not known stored, e.g. after a restart), shared by the requests of one
            prefix (confirmations.py), and not at all for a prompt shorter than a chunk or a
            request that ends before that boundary. An answer the request waits on is first
            judged against the concurrent lookups of its prefix, and asked again when they
            show it short (below).
  load      [start, tier_hit) as the engine planned it (start = the resident frontier); the
            read locks below ``start`` are freed at once. Success -> ``Loaded`` (the engine
            publishes the blocks, the image becomes READY). Failure or lateness ->
            ``LoadFailed``; the span is stored again.
  saves     every READY image boundary past what the tier holds, each store ending at that
            image, sources leased until their bytes are out (an engine-driven save's copy
            completed: its commit follows without them) or the op is terminal; a finished
            request's stores still complete.
  session   ended once, after the request finished and its last transfer is terminal.

A lookup that did not answer is not an empty answer: the request neither loads nor stores.

**Concurrent lookups of one prefix** (issue 41): an answer that a concurrent lookup of the same
prefix made short is asked again. An answer for a request that waits on it (LOOKING_UP) is
*held* first, judged against the other requests' lookups, then settled (``Answered``) or asked
again; an answer for a request already running (CONFIRMING) or finished is settled at once.

Why (measured with lmcache 0.5.6, an L1 that lacks a prefix and an L2 that holds it): two
lookups of one prefix sent together each start an L2 prefetch. The first one's load lands in
L1 while the second is between its L1 pass (which read-locked nothing) and its L1 reservation,
which then fails for the now resident objects ("l1_contended"). The second prefetch keeps only
what its L1 pass locked and answers short (0 when the contended chunks come first), within
milliseconds: its request would compute a prefix the first one is loading at that moment.

The judgement, with X the request judged, ``held`` its answer, and Y any other request whose
lookup shares ``shared(X, Y)`` tokens with X's (on the chunk grid):

  wait    Y's lookup is unanswered and ``shared(X, Y) > held``: Y's answer may show X short.
  owed    over the Y answered since X's lookup was sent (only those can have raced it):
          ``min(shared(X, Y), answer(Y))``, the most the tier was just shown to hold of X.
  short   ``owed > held``: X's locks are freed and its lookup is sent again (same deadline).
          The prefix is resident in L1 now (Y's prefetch landed it), so the new lookup finds
          it, and X's own chunks after it from L2.
  settle  otherwise, or once the lookup's deadline has passed (the answer as it is).

A second answer is judged only against lookups answered while it was in flight, so asking
again stops by itself; ``MAX_ASKS`` bounds it regardless.

**Loads and saves.** A load's outcome: DONE with an image of this layout at its own boundary
-> ``Loaded``, naming the pages and the image, which the engine publishes (blocks registered,
image READY); anything else -> ``LoadFailed`` (the engine drops the image). LATE -> the
request recomputes at once, the op stays quarantined (its leases held) until it resolves.
A save's outcome: DONE -> the image is known stored; FAILED -> the span is stored again later.

Engine-driven loads (``_load_locally``): the lookup's answer located the objects; the engine
checks them against the load and copies them itself (local_load.py). The op is DONE when the
copy is issued (the next forward is ordered after it), and stays live, with its leases, until
the copy completed: then the read locks of its span are freed and its latency is observed
(from the decision to load to the copy's completion). A located answer that cannot serve the
load (a server since gone or replaced, too old, objects not what the load expects) sends the
load through the server instead.

Across ranks rank 0 copies its part the same way and every other rank is sent where its part
sits (``RankedTransfers.submit_copies``: the one copy with rank collapse, else its own objects,
``Located.ranks``); the op is terminal when every rank reported its copy, so the forward that
reads the blocks is sent after every rank copied. A rank that cannot copy fails the op (the
request recomputes on every rank). The span's read locks (the lookup's, on every rank's part)
are freed by one free once the op is terminal and rank 0's copy completed, on success and on
failure alike (``_local_settle``): no part reached the server, and LMCache's free releases
every worker's locks, as many per object as its key declares readers.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from threading import Lock
from typing import NamedTuple

from atom.engine.checkpoints import Checkpoint, CheckpointStore
from atom.engine.connector import Answered, Connector, Loaded, LoadFailed, Outcome, TierAnswer
from atom.engine.sequence import ScheduledSpan, Sequence
from atom.metrics import Registry
from atom.model_api import StateSpec, image_header
from atom.tier.config import OffloadConfig
from atom.tier.operations import (
    LookupOp,
    OpState,
    Phase,
    SaveAhead,
    SettledOps,
    TierRequest,
    TransferOp,
)
from atom.tier.policy import TierPolicy
from atom.tier.scheduler_side.confirmations import (
    Confirmations,
    confirm_end,
    due_from,
    prefix_key,
)
from atom.tier.tier_metrics import TierMetrics
from atom.tier.worker_side.events import EventPool
from atom.tier.worker_side.local_load import LocalLoadError

log = logging.getLogger("atom.offload")

MAX_ASKS = 3  # lookups one request may send: the first, and at most two more for short answers
LATE_MARGIN_S = 1.0  # the step thread gives a load up this long after its own deadline


class Verdict(NamedTuple):
    wait: bool  # a concurrent lookup that may show the answer short is unanswered
    owed: int  # tokens of the lookup the concurrent answers show the tier holds


def shared_tokens(a: list[int], b: list[int], chunk: int) -> int:
    """Tokens of the longest common prefix of ``a`` and ``b``, floored to the chunk grid."""
    end = min(len(a), len(b)) // chunk * chunk
    n = 0
    while n < end and a[n : n + chunk] == b[n : n + chunk]:
        n += chunk
    return n


def judge(st: TierRequest, others: Iterable[TierRequest], chunk: int) -> Verdict:
    """``st``'s held answer against the lookups of ``others`` (``st`` among them is skipped).
    Reads only: the caller acts on the verdict."""
    mine = st.lookup.token_ids
    wait, owed = False, 0
    for other in others:
        if other is st or other.lookup is None or other.asked_at is None:
            continue
        theirs = other.reply
        if theirs is None:  # sent and unanswered: it may still land what st missed
            if not wait and shared_tokens(mine, other.lookup.token_ids, chunk) > st.held:
                wait = True
            continue
        if theirs <= st.held or other.replied_at < st.asked_at:
            continue
        owed = max(owed, min(theirs, shared_tokens(mine, other.lookup.token_ids, chunk)))
    return Verdict(wait, owed)


STORED_KEYS_KEPT = 1 << 16  # image keys remembered as stored (the oldest are forgotten)


class OffloadConnector(Connector):
    def __init__(
        self,
        *,
        config: OffloadConfig,
        spec: StateSpec,
        chunk_size: int,
        images: CheckpointStore,  # read only: which images are READY
        pool_tensor,
        events: EventPool,
        transfers,  # TransferThread (or a test double with the same interface)
        lookups,  # LookupThread
        metrics: Registry,
        notify_progress,
        clock=time.monotonic,
        local=None,  # local_load.LocalLoads: engine-driven loads (None: every load via server)
        mappings=None,  # locator.Mappings: the L1 segments mapped (closed here when idle)
        policy: TierPolicy | None = None,  # what it may do (None: the config's, one rank)
        settled: SettledOps | None = None,  # where the threads post ops (None: its own)
    ):
        self.cfg, self.spec, self.chunk_size = config, spec, chunk_size
        # the engine's KV-event publisher (``atom.kv_events``) when events are on: told of
        # every save that settled, as blocks the tier now holds
        self.kv_events = None
        self.policy = policy or TierPolicy.of(config)
        self.images, self.pool_tensor = images, pool_tensor
        self.events, self.transfers, self.lookups = events, transfers, lookups
        self.notify, self.clock = notify_progress, clock
        self.settled = settled if settled is not None else SettledOps(notify_progress)
        # the threads' end of it (any thread): an op settled, folded in at the next update
        self.post = self.settled.post
        self._emitted: list[Outcome] = []  # for the engine, returned by update()
        self._lock = Lock()  # guards _requests / ops against the metrics thread
        self._requests: dict[int, TierRequest] = {}  # seq_id -> alive or with live transfers
        self._stored: OrderedDict[int, None] = OrderedDict()  # image keys the tier holds
        self.confirmations = Confirmations()  # HBM-covered requests of one prefix: one lookup
        self.health = transfers.health  # the worker side's health record (read only)
        self._epoch = self.health.epoch
        self._seen_down = False  # the step thread saw the tier unhealthy since its last update
        self.local, self.mappings = local, mappings
        self.tier_metrics = TierMetrics(metrics, self)
        self._ahead_open = False  # reservations sent ahead for the current step
        # LMCache request ids: this connector's random prefix and a count (a uuid4 per
        # request read os.urandom on the step thread: 0.3 ms a call on a 2-core CPU host)
        self._id_prefix, self._ids = uuid.uuid4().hex[:8], itertools.count()
        # what each update acts on, so that one with nothing to do does not walk every
        # request (two sweeps of 64 requests and the session check were a third of update's
        # time): the deadlines of lookups and loads in order, the answers held for judging,
        # and the finished requests whose sessions are still to end
        self._deadlines: list[tuple[float, int, TierRequest, LookupOp | TransferOp]] = []
        self._held: list[TierRequest] = []
        self._closing: list[TierRequest] = []
        self._due_order = itertools.count()  # (ties of the deadlines' heap)

    # ---- computed state (also read by the metrics thread) ----------------------------------

    def _live_ops(self) -> list[TransferOp]:
        with self._lock:
            return [op for st in self._requests.values() for op in st.ops]

    @property
    def live_ops(self) -> int:
        return len(self._live_ops())

    @property
    def quarantined(self) -> set[TransferOp]:
        """Transfers given up on (late) whose fate is unknown: their blocks stay leased."""
        return {op for op in self._live_ops() if op.was_late and op.leased}

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(op.page_blocks) for op in self.quarantined)

    def request_state(self, seq: Sequence) -> TierRequest | None:
        return self._requests.get(seq.seq_id)

    def is_stored(self, image: Checkpoint) -> bool:
        """The tier is known to hold this image (a save of it or a load from it succeeded)."""
        return image.key in self._stored

    def is_saving(self, image: Checkpoint) -> bool:
        return any(op.kind == "save" and op.image.key == image.key for op in self._live_ops())

    # ---- Connector: step thread ------------------------------------------------------------

    def update(self) -> list[Outcome]:
        self._fold()
        return self._drain()

    def no_forward(self) -> None:
        self.lookups.flush()  # the lookups this step queued (no forward to send them beside)

    def while_forward(self) -> list[Outcome]:
        """The step's forward is queued on the device: fold in what settled while the step
        thread would wait for the device anyway (the next update has only what settles after
        this)."""
        self._fold()
        return self._drain()

    def _fold(self) -> None:
        """Fold in what the threads settled, the deadlines passed, the held answers, and the
        sessions to end."""
        epoch, healthy = self.health.epoch, self.health.healthy
        # the tier may have lost everything: store again from 0. The epoch records an outage
        # the transfer thread's rounds saw; one while the tier had no transfers (its thread
        # blocks when idle) only this thread sees, as the steps go on
        lost = epoch != self._epoch or (healthy and self._seen_down)
        self._epoch, self._seen_down = epoch, not healthy
        if lost:
            self.tier_lost()
        if self.local is not None:
            self.local.poll()  # copies that completed: their locks are freed, ops retired
            if self.mappings is not None:
                self.mappings.close_idle()
        for op in self.settled.take():
            if isinstance(op, LookupOp):
                self._on_lookup(op)
            elif op.kind == "load":
                self._on_load(op)
            else:
                self._on_save(op)
        self._sweep_deadlines()
        self._judge_answers()
        self._end_sessions()
        self.lookups.flush()

    def _drain(self) -> list[Outcome]:
        """The outcomes produced since the last call returned them, in order."""
        emitted, self._emitted = self._emitted, []
        return emitted

    def tier_lost(self) -> None:
        """The tier may hold none of what it held (a restart, a clear): trust nothing stored
        before, and store again what the running requests compute (those HBM covered and
        that have not asked yet ask now: their prefix too may be gone)."""
        self._stored.clear()
        self.confirmations.clear()
        for st in list(self._requests.values()):
            st.saved_upto = 0
            if st.tier_has is not None:
                st.tier_has = 0
            self._confirm_when_due(st, now=True)

    def _state(self, seq: Sequence) -> TierRequest:
        st = self._requests.get(seq.seq_id)
        if st is None:
            st = TierRequest(seq, f"{seq.request_id}-{self._id_prefix}{next(self._ids):x}")
            with self._lock:
                self._requests[seq.seq_id] = st
        return st

    def lookup(self, seq: Sequence, local_hit: int) -> TierAnswer | None:
        st = self._state(seq)
        if st.phase is Phase.NEW:
            self._first_lookup(st, local_hit)
        if st.phase is Phase.LOOKING_UP:
            return None
        return TierAnswer(st.answer if st.phase is Phase.ANSWERED else 0)

    def _first_lookup(self, st: TierRequest, local_hit: int) -> None:
        if not self.policy.may_load or not self.health.healthy:
            # save-only: store everything, load nothing; tier down: no answer, neither
            st.tier_has = 0 if self.health.healthy else None
            st.to(Phase.RUNNING)
            return
        asked = st.seq.num_tokens - 1  # a hit never covers the prompt's last token
        boundary = (asked // self.chunk_size) * self.chunk_size
        if local_hit >= boundary:  # the tier cannot add a token: admit now
            st.to(Phase.CONFIRMING)
            if boundary == 0:
                self._confirmed(st, 0)  # nothing the tier could hold: a miss, unasked
                return
            st.confirm_at = boundary + self.chunk_size  # its first boundary past HBM's
            st.confirm_due = due_from(st.seq, st.confirm_at, self.chunk_size)
            # a prefix this connector has not seen stored (the tier may have lost it: a
            # restart) is confirmed now, so that it is stored again from HBM; one it stored
            # or loaded is confirmed only when the request has something to store
            self._confirm_when_due(st, now=not self._known_stored(st.seq, boundary))
            return
        st.to(Phase.LOOKING_UP)
        self._send_lookup(st, asked, self.clock() + self.cfg.lookup_timeout_s)
        st.session_open = True

    def _known_stored(self, seq: Sequence, boundary: int) -> bool:
        """This connector stored or loaded the image at ``boundary`` since the tier was last
        lost (saves store a prefix in order, so the chunks before it went first)."""
        n = boundary // self.spec.block_size
        if len(seq.block_hashes) < n:
            return False
        image = self.images.ready_image(seq.block_hashes[n - 1])
        return image is not None and self.is_stored(image)

    def _confirm_when_due(self, st: TierRequest, now: bool = False) -> None:
        """A CONFIRMING request asks what the tier holds of the prefix HBM gave it (``now``,
        or once it nears a boundary it would store: ``CONFIRM_LEAD`` of a chunk before it;
        until then it has nothing to save, and a request whose ``max_tokens`` end it before
        that boundary asks nothing).
        The requests of one prefix share the confirmation (``confirmations.py``)."""
        asked = st.lookup is not None or st.confirm_key is not None
        if st.phase is not Phase.CONFIRMING or not st.confirm_at or asked:
            return
        end = confirm_end(st.seq, st.confirm_at, self.chunk_size, self.spec.block_size, now)
        if end is None:
            return
        st.confirm_key = key = prefix_key(st.seq, end, self.spec.block_size)
        if key is not None:
            how, held = self.confirmations.join(key, st, self.clock())
            if how != "leading":  # settled by another request's confirmation, now or later
                self.tier_metrics.lookups.inc(outcome="shared")
                if how == "known":
                    self._confirmed(st, held)
                return
        deadline = self.clock() + self.cfg.lookup_timeout_s
        self._send_lookup(st, end, deadline)
        st.session_open = True

    def _confirmed(self, st: TierRequest, hit: int | None) -> None:
        """A CONFIRMING request settled by a shared confirmation (``hit`` None: unknown, so
        neither load nor store, as its leader)."""
        if st.phase is not Phase.CONFIRMING:
            return  # finished meanwhile
        st.answer = hit or 0
        if hit is not None:
            st.tier_has = st.saved_upto = hit
        st.to(Phase.RUNNING)
        if hit is not None and st.seq.block_table:
            self._plan_saves(st)

    def _settle_followers(self, st: TierRequest, hit: int | None) -> None:
        if st.confirm_key is not None:
            for follower in self.confirmations.answered(st.confirm_key, st, hit, self.clock()):
                self._confirmed(follower, hit)

    def holds(self, seq: Sequence) -> bool:
        st = self._requests.get(seq.seq_id)
        return st is not None and st.holds

    def settle_lookup(self, seq: Sequence) -> None:
        st = self._requests.get(seq.seq_id)
        if st is not None and st.phase is Phase.ANSWERED:
            st.located = None
            self._free_locks(st)
            st.to(Phase.RUNNING)

    def start_load(
        self, seq: Sequence, start: int, end: int, blocks: list[int], image: Checkpoint
    ) -> list[Outcome]:
        st = self._state(seq)
        if st.phase is not Phase.ANSWERED or end > st.locked:
            raise RuntimeError(f"{st.lmc_id}: load [{start}, {end}) without its lookup's locks")
        if start > 0:
            self.lookups.free_locks(st.lmc_id, seq.tokens, 0, start)
        st.locked = 0  # [start, end) passes to the load; the server frees what lies past end
        if end < st.answer:
            self.lookups.free_locks(st.lmc_id, seq.tokens, end, st.answer)
        op = self._new_op("load", st, start, end, blocks, image)
        st.load = op
        st.to(Phase.LOADING)
        self._due(op.deadline + LATE_MARGIN_S, st, op)
        located, st.located = st.located, None
        if self.local is None or not self._load_locally(st, op, located):
            self._launch(st, op)  # the server copies it
        return self._drain()

    def before_forward(self, spans: list[ScheduledSpan]) -> None:
        """Reserve now the saves this step's commits will make, where the transfers can
        (engine-driven saves): one per span that ends on a chunk boundary with its image,
        from what the request stored so far (``_plan_saves`` makes the same op then, unless
        another image or a stored one changes it). The reservation's round-trip overlaps the
        forward; one the step does not claim is given back (``ahead_end``).

        A verify span is reserved as if its drafts are accepted (its image is kept only
        then): the keys are those of the tokens with the drafts, a copy (the live list lacks
        them until the commit). A rejection costs the reservation given back."""
        reserve = getattr(self.transfers, "reserve_ahead", None)  # not every transfers can
        if self._ahead_open:  # a step that failed before after_step
            self.transfers.ahead_end()
            self._ahead_open = False
        if reserve is None or not self.policy.may_store or not self.health.healthy:
            return
        chunk, ahead = self.chunk_size, []
        for sp in spans:
            st = self._requests.get(sp.seq.seq_id)
            if (
                st is None
                or st.tier_has is None
                or sp.image is None
                or sp.end % chunk
                or sp.end <= st.saved_upto
            ):
                continue
            tokens = st.seq.tokens + list(sp.drafts) if sp.drafts else st.seq.tokens
            ahead.append(SaveAhead(st.lmc_id, tokens, st.saved_upto, sp.end))
        if ahead:
            self._ahead_open = reserve(ahead)

    def after_step(self, seqs: list[Sequence]) -> list[Outcome]:
        chunk, requests = self.chunk_size, self._requests
        for seq in seqs:
            st = requests.get(seq.seq_id)
            if st is None:
                continue
            # (most requests, most steps, neither confirm nor reach a boundary: tested
            # here, not in a call each; a request whose tier state is unknown stores
            # nothing until its answer, which then plans its saves)
            if st.phase is Phase.CONFIRMING and seq.num_computed >= st.confirm_due:
                self._confirm_when_due(st)
            if st.tier_has is not None and st.saved_upto + chunk <= seq.num_computed:
                self._plan_saves(st)
        if self._ahead_open:  # after this step's saves: what they did not claim is given back
            self.transfers.ahead_end()
            self._ahead_open = False
        self.lookups.flush()  # the confirmations asked above, in the step that asked them
        return self._drain()

    def request_finished(self, seq: Sequence) -> None:
        st = self._requests.get(seq.seq_id)
        if st is not None:
            self._drop_held(st)
            self._free_locks(st)
            st.to(Phase.DONE)
            self._closing.append(st)

    def leases(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for op in self._live_ops():
            if op.leased:
                for b in op.page_blocks:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def busy(self) -> bool:
        return any(st.ops or st.lookup_pending for st in self._requests.values())

    def health(self) -> dict:
        return {"healthy": self.health.healthy}

    # ---- lookups ------------------------------------------------------------------------

    def _send_lookup(self, st: TierRequest, length: int, deadline: float) -> None:
        """Ask about the request's first ``length`` tokens (its live list: not copied here)."""
        st.lookup = LookupOp(st.lmc_id, st.seq.tokens, length, deadline, st)
        st.asked_at, st.replied_at, st.asks = self.clock(), None, st.asks + 1
        self._due(deadline, st, st.lookup)
        self.lookups.lookup(st.lookup)

    def _due(self, at: float, st: TierRequest, op: LookupOp | TransferOp) -> None:
        """``op`` of ``st`` is given up at ``at`` if it is still pending then."""
        heapq.heappush(self._deadlines, (at, next(self._due_order), st, op))

    def _on_lookup(self, op: LookupOp) -> None:
        st: TierRequest = op.owner
        if op.finished_at is not None:
            self.tier_metrics.lookup_latency.observe(op.finished_at - op.created_at)
        if st.lookup is not op or st.answer is not None:
            return  # given up (late): the lookup thread frees what it locked
        st.replied_at = self.clock()
        if op.state is not OpState.DONE:
            self.tier_metrics.lookups.inc(outcome="failed")
            log.debug("lookup %s: %s", op.lmc_id, op.error)
            self._settle_answer(st, 0, known=False)
            return
        hit = op.hit // self.chunk_size * self.chunk_size
        st.locked = hit
        if st.phase is Phase.LOOKING_UP:
            st.held = hit  # judged against concurrent lookups first (_judge_answers)
            self._held.append(st)
        else:
            self._settle_answer(st, hit)

    def _judge_answers(self) -> None:
        """Act on held answers: wait while a concurrent lookup of the same prefix may show one
        short, ask a short one again (its locks freed first), settle the rest. An answer still
        held at its lookup's deadline is settled as it is."""
        if not self._held:
            return
        now, held = self.clock(), self._held
        self._held = []
        for st in held:
            if st.held is None:
                continue  # dropped meanwhile (finished)
            verdict = judge(st, self._requests.values(), self.chunk_size)
            in_time = now < st.lookup.deadline
            if verdict.wait and in_time:
                self._held.append(st)
                continue
            if verdict.owed > st.held and in_time and st.asks < MAX_ASKS:
                self.tier_metrics.lookups.inc(outcome="short")
                log.debug("lookup %s: %d of %d; asked again", st.lmc_id, st.held, verdict.owed)
                st.held = None
                self._free_locks(st)
                self._send_lookup(st, st.lookup.length, st.lookup.deadline)
            else:
                hit, st.held = st.held, None
                self._settle_answer(st, hit)

    def _drop_held(self, st: TierRequest) -> None:
        """A held answer of a request that will not load it: final as it is (its locks stay
        counted in ``locked``, for the caller to free)."""
        if st.held is not None:
            st.answer, st.held = st.held, None

    def _settle_answer(self, st: TierRequest, hit: int, known: bool = True) -> None:
        """The lookup's final answer: ``hit`` tokens (locked on the server), or no answer
        (``known`` False: neither load nor store)."""
        st.answer = hit
        if known:
            st.tier_has = st.saved_upto = hit
            self.tier_metrics.lookups.inc(outcome="hit" if hit else "miss")
        self._settle_followers(st, hit if known else None)
        st.locked = hit
        op = st.lookup
        st.located = op.located if op.located is not None and op.located.end == hit else None
        if st.phase is Phase.LOOKING_UP and hit:
            st.to(Phase.ANSWERED)
            self._emitted.append(Answered(st.seq))
            return
        self._free_locks(st)  # nothing to load: the request runs, or finished, without it
        if st.phase is Phase.LOOKING_UP:
            st.to(Phase.RUNNING)
            self._emitted.append(Answered(st.seq))
        elif st.phase is Phase.CONFIRMING:
            st.to(Phase.RUNNING)
            if st.seq.block_table:
                self._plan_saves(st)

    def _free_locks(self, st: TierRequest) -> None:
        if st.locked:
            self.lookups.free_locks(st.lmc_id, st.seq.tokens, 0, st.locked)
            st.locked = 0

    def _sweep_deadlines(self) -> None:
        """The step thread's own bound: a lookup or load that the threads have not answered
        by its deadline (a load's plus ``LATE_MARGIN_S``) is treated as late here too."""
        now, due = self.clock(), self._deadlines
        while due and due[0][0] < now:
            _, _, st, op = heapq.heappop(due)
            if isinstance(op, LookupOp):
                if st.lookup is op and st.lookup_pending and op.mark_late():
                    st.answer = 0  # no answer: neither load nor store (the thread frees locks)
                    self.tier_metrics.lookups.inc(outcome="late")
                    self._settle_followers(st, None)
                    if st.phase in (Phase.LOOKING_UP, Phase.CONFIRMING):
                        if st.phase is Phase.LOOKING_UP:
                            self._emitted.append(Answered(st.seq))
                        st.to(Phase.RUNNING)
            elif st.load is op and not op.was_late:
                op.mark_late()
                self._on_load(op)

    # ---- loads ----------------------------------------------------------------------------

    def _on_load(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if op.state is OpState.LATE:
            if not op.was_late:
                op.was_late = True  # quarantined until it resolves
                self.tier_metrics.loads.inc(outcome="late")
                self._load_failed(st, op, "deadline passed")
            return
        op.reported = True
        end = self._local_settle if op.local else self._retire
        if op.was_late:  # the request moved on; the quarantine ends
            end(st, op)
            return
        why = self._check_loaded(op)
        if why is None:
            self._load_done(st, op)
        else:
            self.tier_metrics.loads.inc(outcome="failed")
            end(st, op)
            self._load_failed(st, op, why)

    def _check_loaded(self, op: TransferOp) -> str | None:
        """None if the load put an image of this layout and of its own boundary in place."""
        if op.state is not OpState.DONE:
            return op.error or "failed"
        if op.local:
            return None  # checked in the source bytes before the copy (no device read)
        tag, position = image_header(self.spec, self.pool_tensor, op.units)
        if tag != self.spec.layout_tag:
            return "image of another layout"
        if position != op.end:
            return f"image of boundary {position}, expected {op.end}"
        return None

    def _load_done(self, st: TierRequest, op: TransferOp) -> None:
        """The loaded pages and image, named for the engine to publish while the op still
        holds them (its ``Unlease`` comes after), then the request's (or, if it finished
        meanwhile, the prefix cache's)."""
        self.tier_metrics.loads.inc(outcome="done")
        self.tier_metrics.bytes.inc(op.nbytes, direction="load")
        if not op.local and op.finished_at is not None:
            self.tier_metrics.latency.observe(op.finished_at - op.created_at, op="load")
        self._remember_stored(op.image)  # it came from the tier
        st.load = None
        self._emitted.append(Loaded(st.seq, op.end, op.image, op.start, tuple(op.page_blocks)))
        if op.local:  # retired once its copy completed too (_local_settle)
            self._local_settle(st, op)
        else:
            self._retire(st, op)
        if st.alive:
            st.saved_upto = max(st.saved_upto, op.end)
            st.to(Phase.RUNNING)

    def _load_locally(self, st: TierRequest, op: TransferOp, located) -> bool:
        """Copy ``op`` from where the lookup located it (``located``, or None: nowhere);
        False: send it to the server (counted as via_server)."""
        why = self._local_refusal(located)
        plan = None
        if why is None:
            try:
                plan = self.local.plan(located, op.start, op.end, op.page_blocks, op.units)
            except LocalLoadError as exc:
                why = str(exc)
        if plan is None:
            self.tier_metrics.local_loads.inc(outcome="via_server")
            log.debug("load %s through the server: %s", op, why)
            return False
        op.local = True
        op.mark_in_flight()
        with self._lock:
            st.ops.add(op)
        self.local.copy(
            located,
            plan,
            lambda t, st=st, op=op: self._local_copied(st, op, t),
            decided_at=op.created_at,
        )
        self.tier_metrics.local_loads.inc(outcome="copied")
        submit_copies = getattr(self.transfers, "submit_copies", None)
        if submit_copies is not None:  # across ranks: terminal once every rank copied
            submit_copies(op, located.where(), located.ranks)
            return True
        op.resolve(True)
        self._on_load(op)
        return True

    def _local_refusal(self, located) -> str | None:
        alive = getattr(self.transfers, "server_alive", None)
        if located is None:
            return "the answer says nowhere (mapping in progress, locate failed or timed out)"
        if self.mappings is None or located.mapping is not self.mappings.current:
            return "the server that located it was replaced"
        if not self.health.healthy or (alive is not None and not alive()):
            return "the server is down"
        if self.clock() - located.at > self.cfg.located_max_age_s:
            return f"located {self.clock() - located.at:.0f} s ago"
        return None

    def _local_copied(self, st: TierRequest, op: TransferOp, done_at: float) -> None:
        """Rank 0's copy completed."""
        op.copied_at = done_at
        self._local_settle(st, op)

    def _local_settle(self, st: TierRequest, op: TransferOp) -> None:
        """An engine-driven load ends once rank 0's copy completed and the step thread acted
        on the op's outcome (across ranks: every rank's part is terminal): the span's read
        locks are freed (once: one free releases every reader's lock), its latency observed
        (a load done in time), the op retired."""
        if op.copied_at is None or not op.reported or op.locks_freed:
            return
        op.locks_freed = True
        self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        if op.state is OpState.DONE and not op.was_late:
            done_at = max(op.copied_at, op.finished_at or op.copied_at)
            self.tier_metrics.latency.observe(done_at - op.created_at, op="load")
        self._retire(st, op)

    def _load_failed(self, st: TierRequest, op: TransferOp, why: str) -> None:
        log.warning("tier load %s failed (%s); recomputing [%d, %d)", op, why, op.start, op.end)
        # a retrieve that reached the server releases them as it ends; an engine-driven load
        # frees them once every copy from them is known complete (_local_settle)
        if not op.reached_server and not op.local:
            self.lookups.free_locks(st.lmc_id, op.token_ids, op.start, op.end)
        st.load = None
        if st.alive:
            st.to(Phase.RUNNING)
            # the request computes the span itself; it is stored again (the tier lost or
            # refused it), and what the tier said it held past start is doubtful
            st.saved_upto = min(st.saved_upto, op.start)
            if st.tier_has is not None:
                st.tier_has = min(st.tier_has, op.start)
        # the engine drops the destination image (and, for a running request, recomputes)
        self._emitted.append(LoadFailed(st.seq, op.start, op.image))

    # ---- saves --------------------------------------------------------------------------

    def _plan_saves(self, st: TierRequest) -> None:
        """The only maker of saves (every path that stores calls it): the policy's
        ``may_store`` is asked here and nowhere else. Most calls (every running request,
        every step) find no new boundary: that is checked first, before the server's health."""
        seq, chunk = st.seq, self.chunk_size
        b = st.saved_upto + chunk
        if b > seq.num_computed:
            return
        if st.tier_has is None or not self.policy.may_store or not self.health.healthy:
            return
        bs = self.spec.block_size
        while b <= seq.num_computed:
            image = self.images.ready_image(seq.block_hashes[b // bs - 1])
            if image is not None:
                # stored is trusted only where this request's lookup confirmed it: the server
                # may have evicted or lost what an older save put there
                known = self.is_stored(image) and b <= st.tier_has
                if not (known or self.is_saving(image)):
                    blocks = seq.block_table[st.saved_upto // bs : b // bs]
                    st.session_open = True
                    self._launch(st, self._new_op("save", st, st.saved_upto, b, blocks, image))
                st.saved_upto = b
            b += chunk

    def _on_save(self, op: TransferOp) -> None:
        st: TierRequest = op.owner
        if op.reported:
            return
        if not op.terminal:  # copied (an engine-driven save, its commit to come), or late
            if op.copied_at is not None:
                self._release_save(op, op.copied_at)
            if op.state is OpState.LATE and not op.was_late:
                op.was_late = True
                self.tier_metrics.saves.inc(outcome="late")
            return
        op.reported = True
        self._release_save(op, op.copied_at or op.finished_at)
        self._retire(st, op)
        if op.state is OpState.DONE:
            self._remember_stored(op.image)
            self._publish_stored(st, op)
            self.tier_metrics.saves.inc(outcome="done")
            self.tier_metrics.bytes.inc(op.nbytes, direction="save")
            if op.latency_s is not None:
                self.tier_metrics.latency.observe(op.latency_s, op="save")
        else:
            if not op.was_late:
                self.tier_metrics.saves.inc(outcome="failed")
            st.saved_upto = min(st.saved_upto, op.start)  # store it again later
            log.debug("tier save %s failed: %s", op, op.error)

    def _release_save(self, op: TransferOp, at: float | None) -> None:
        """A save's sources are free once its bytes are out: when its copy completed (an
        engine-driven save, before its commit) or when it is terminal; the hold observed
        ends ``at`` (the copy's completion where there was one, though the step thread may
        learn of it with the terminal outcome)."""
        if not op.leased:
            return
        self._emitted.append(op.release())
        if at is not None and op.submitted_at is not None:
            self.tier_metrics.save_hold.observe(max(0.0, at - op.submitted_at))

    def _publish_stored(self, st: TierRequest, op: TransferOp) -> None:
        """Tell the KV-event publisher (``kv_events``, when events are on) that the tier holds
        the saved blocks [op.start, op.end): their chained hashes, the parent and tokens."""
        events = self.kv_events
        if events is None:
            return
        bs, hashes = self.spec.block_size, st.seq.block_hashes
        first, last = op.start // bs, op.end // bs
        parent = hashes[first - 1] if first else None
        events.tier_stored(hashes[first:last], token_ids=op.token_ids[op.start : op.end],
                           parent_block_hash=parent)  # fmt: skip

    def _remember_stored(self, image: Checkpoint) -> None:
        self._stored[image.key] = None
        self._stored.move_to_end(image.key)
        if len(self._stored) > STORED_KEYS_KEPT:
            self._stored.popitem(last=False)

    # ---- common -------------------------------------------------------------------------

    def _new_op(self, kind: str, st: TierRequest, start: int, end: int, blocks, image):
        """The one TransferOp factory: the op leases its blocks and image from here on."""
        op = TransferOp(
            kind,
            st.lmc_id,
            st.seq.tokens,  # the live list: ops read tokens [0, end), which never change
            start,
            end,
            list(blocks),
            image,
            self.clock() + self.cfg.transfer_timeout_s,
            owner=st,
        )
        op.nbytes = (len(op.page_blocks) + len(op.units)) * self.spec.block_bytes  # pages + image
        self._emitted.append(op.lease())
        return op

    def _launch(self, st: TierRequest, op: TransferOp) -> None:
        op.event = self.events.acquire()
        with self._lock:
            st.ops.add(op)
        self.transfers.submit(op)

    def _retire(self, st: TierRequest, op: TransferOp) -> None:
        """A terminal op gives back its event and leases (once)."""
        if op.leased:
            self._emitted.append(op.release())
        if op.event is not None:
            self.events.recycle(op.event)
            op.event = None
        with self._lock:
            st.ops.discard(op)

    def _end_sessions(self) -> None:
        """Forget the finished requests with no transfer live and no lookup pending (one may
        still take locks: its answer frees them), ending their sessions."""
        closing, self._closing = self._closing, []
        for st in closing:
            if st.ops or st.lookup_pending:
                self._closing.append(st)
                continue
            self._free_locks(st)
            if st.session_open:
                self.lookups.end_session(st.lmc_id)
                st.session_open = False
            with self._lock:
                del self._requests[st.seq.seq_id]

    def shutdown(self, timeout_s: float) -> list[Outcome]:
        """Stores in flight get ``timeout_s`` to finish; then every lease is released and
        every session ended (a lookup still pending is given up and its locks freed)."""
        self.transfers.stop(timeout_s)
        if self.local is not None:
            self.local.drain()  # local copies complete quickly: their locks are freed below
        outcomes = self.update()
        for st in list(self._requests.values()):
            lk = st.lookup
            if st.lookup_pending and lk.mark_late():
                st.answer = 0
                self.lookups.free_locks(st.lmc_id, lk.tokens, 0, lk.length)
            for op in list(st.ops):
                op.resolve(False, "shutdown")
                if op.local:  # a copy that completed: its locks are freed now
                    op.reported = True
                    self._local_settle(st, op)
                self._retire(st, op)
            if st.alive:
                self._drop_held(st)
                self._free_locks(st)
                st.to(Phase.DONE)
                self._closing.append(st)
        self._end_sessions()
        self.lookups.stop(timeout_s)
        return outcomes + self._drain()
