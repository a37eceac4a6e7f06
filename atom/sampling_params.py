"""Per-request sampling parameters."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
