"""Per-request sampling parameters."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

MAX_LOGPROBS = 20  # most alternatives recorded per token (OpenAI's top_logprobs limit)


class SamplingParams(BaseModel):
    """How to sample one request. temperature 0 is greedy; ``seed`` makes sampling repeatable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = 16  # None: as many as fit (max_model_len and the pool)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # log-probabilities (the model's raw log-softmax, before penalties, temperature, top-k/p):
    # None records none; k records the sampled token's and the k most likely alternatives
    logprobs: int | None = None
    # the same for every prompt token from the second on; such a request computes its whole
    # prompt (no prefix-cache or tier hit), as vLLM does
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this for each token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM: prompt + output tokens: positive / r, negative * r
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens

    def __init__(self, max_tokens: int | None = 16, **kw):
        super().__init__(max_tokens=max_tokens, **kw)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens={v} must be >= 1")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"temperature={v} must be >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p={v} must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k={v} must be >= 0 (0 = off)")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"{v} must be in [0, {MAX_LOGPROBS}] (or None)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if not -2 <= v <= 2:  # also refuses NaN
            raise ValueError(f"{v} must be in [-2, 2] (0 = off)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{v} must be a finite number > 0 (1 = off)")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"min_tokens={v} must be >= 0")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}"
            )
        return self

    @property
    def penalized(self) -> bool:
        """Any penalty is on (greedy then takes the argmax of the penalized logits)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
