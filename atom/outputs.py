"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass

from atom.engine.sequence import Sequence, TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    hbm_hit_tokens: int
    tier_hit_tokens: int
    computed_prompt_tokens: int
    preemptions: int
    tier_tokens_recomputed: int  # held by the tier, computed for lack of room to load them
    ttft_s: float | None
    latency_s: float | None
    itl_s: list[float]  # gaps between consecutive output tokens
    logprobs: list[TokenLogprob] | None = None  # per output token, with params.logprobs
    # per prompt token (None for the first), with params.prompt_logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def from_sequence(cls, seq: Sequence, text: str) -> RequestOutput:
        c = seq.counters
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        latency = seq.finish_time - seq.arrival_time if seq.finish_time else None
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt),
            token_ids=list(seq.output),
            text=text,
            finish_reason=seq.finish_reason or "",
            prompt_tokens=c.prompt_tokens,
            hbm_hit_tokens=c.hbm_hit_tokens,
            tier_hit_tokens=c.tier_hit_tokens,
            computed_prompt_tokens=c.computed_prompt_tokens,
            preemptions=c.preemptions,
            tier_tokens_recomputed=c.tier_tokens_recomputed,
            ttft_s=ttft,
            latency_s=latency,
            itl_s=[b - a for a, b in zip(seq.token_times, seq.token_times[1:])],
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=(
                [None, *seq.prompt_logprobs] if seq.params.prompt_logprobs is not None else None
            ),
        )
