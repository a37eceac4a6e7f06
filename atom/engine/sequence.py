"""One request: its tokens, status, block table, state slot and counters; its part of a step.

Only the engine scheduler changes a sequence's status, blocks, slot, resume point and counters;
the tier answers with values (``atom.engine.connector``) and never writes here.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom.engine.checkpoints import Checkpoint


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model's raw distribution (log-softmax of the
    logits, before penalties, temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; may hold a prepared prefix (a landed tier load)
    WAITING_FOR_TIER = "waiting_for_tier"  # a tier lookup or load is in flight for it
    RUNNING = "running"  # holds blocks and a state slot
    FINISHED = "finished"


@dataclass
class SeqCounters:
    """Where the prompt's tokens came from. Each prompt token is attributed once, by the first
    admission or forward that made it committed: a preempted request that re-reads its own
    blocks does not count them again (hbm + tier + computed == prompt tokens)."""

    prompt_tokens: int = 0
    hbm_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    preemptions: int = 0
    failed_loads: int = 0
    # tokens the tier held beyond the hit this admission ran with, computed instead: there was
    # no room to load them and no running request to wait for
    tier_tokens_recomputed: int = 0
    attributed: int = 0  # prompt tokens [0, attributed) have a source

    def admitted(self, hit: int, local: int) -> None:
        """An admission resumed at ``hit``, of which [0, local) came from the local pool."""
        hit = min(hit, self.prompt_tokens)
        if hit > self.attributed:
            local = min(max(local, self.attributed), hit)
            self.hbm_hit_tokens += local - self.attributed
            self.tier_hit_tokens += hit - local
            self.attributed = hit

    def computed(self, end: int) -> None:
        """A forward committed tokens up to ``end``."""
        end = min(end, self.prompt_tokens)
        if end > self.attributed:
            self.computed_prompt_tokens += end - self.attributed
            self.attributed = end


@dataclass(frozen=True)
class Prepared:
    """A prefix made ready outside a forward (a landed tier load): the sequence holds the
    blocks of [0, tokens) (and those of its first chunk) and a pinned READY image at
    ``tokens``; [0, local_tokens) came from the local pool, the rest from the tier."""

    tokens: int
    image: Checkpoint
    local_tokens: int


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    request_id: str = ""
    eos_token_id: int | None = None
    max_tokens: int = 0  # resolved by the engine at admission (params.max_tokens or what fits)
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_computed: int = 0  # tokens whose KV and state are committed
    # speculative decoding: proposed tokens for positions [num_tokens, ...), verified by the
    # next decode span (cleared when the sequence leaves the running set); sampled ones are an
    # ``atom.engine.drafter.Proposal``, a list that also holds the q each was drawn from
    draft: list[int] = field(default_factory=list)
    slot: int | None = None
    prepared: Prepared | None = None
    finish_reason: str | None = None
    counters: SeqCounters = field(default_factory=SeqCounters)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # with params.logprobs: one per output token, recorded before the token is appended
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs: one per prompt token from the second on
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.request_id = self.request_id or f"req-{self.seq_id}"
        self.counters.prompt_tokens = len(self.prompt)
        self.max_tokens = self.max_tokens or self.params.max_tokens or 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, computed={self.num_computed}/"
            f"{self.num_tokens}, blocks={len(self.block_table)}, slot={self.slot})"
        )


@dataclass(eq=False)
class ScheduledSpan:
    """One sequence's part of a step, as the scheduler planned it: compute [start, end)."""

    seq: Sequence
    start: int
    end: int
    restore: Checkpoint | None = None  # copy into the slot before the forward
    image: Checkpoint | None = None  # PENDING: copy the slot into it after the forward
    # speculative decoding: draft tokens for positions [num_tokens, end) to verify (the span
    # is then [num_tokens - 1, num_tokens + len(drafts)): one verify forward)
    drafts: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        return self.end - len(self.drafts) == self.seq.num_tokens

    @property
    def decodes(self) -> bool:
        """A decode step's span: the last token, a generated one, and its drafts (if any);
        the model computes it as decode rows (any other span as prefill: ``Span.prefill``)."""
        s = self.seq
        return self.start == s.num_tokens - 1 >= s.num_prompt and self.samples

    def token_ids(self) -> list[int]:
        """The span's input tokens: committed ones, then the drafts."""
        return self.seq.tokens[self.start : self.end - len(self.drafts)] + list(self.drafts)
