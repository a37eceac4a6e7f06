"""One request: its tokens, status, block table, state slot and counters."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from atom.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, holds nothing
    WAITING_FOR_TIER = "waiting_for_tier"  # a tier lookup or load is in flight for it
    RUNNING = "running"  # holds blocks and a state slot
    FINISHED = "finished"


@dataclass
class SeqCounters:
    """Where the prompt's tokens came from in the admission that ran to completion."""

    prompt_tokens: int = 0
    hbm_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    preemptions: int = 0
    failed_loads: int = 0
    # tokens the tier held beyond the hit this admission ran with, computed instead: there was
    # no room to load them and no running request to wait for
    tier_tokens_recomputed: int = 0


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    request_id: str = ""
    eos_token_id: int | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_computed: int = 0  # tokens whose KV and state are committed
    slot: int | None = None
    resume: Any = None  # a connector.Resume: a prefix prepared outside a forward
    connector_state: Any = None  # opaque to the engine: the tier's per-request state
    tier_unloaded: int = 0  # a tier answer this admission could not load (no room)
    finish_reason: str | None = None
    counters: SeqCounters = field(default_factory=SeqCounters)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.request_id = self.request_id or f"req-{self.seq_id}"
        self.counters.prompt_tokens = len(self.prompt)

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
