"""OpenAI-compatible request bodies. Unknown fields are refused (HTTP 400), never ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from atom.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension
    n: int = 1
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # extension
    ignore_eos: bool = False  # extension
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported; send 0 or omit the field")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise ValueError("send one prompt per request (batched prompts: one request each)")
            self.prompt = p[0]
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] = ""
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _max(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens <= 0:
                raise ValueError(
                    f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}"
                )
            self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self


def render_chat(messages: list[ChatMessage]) -> str:
    """A plain chat template: one "<|role|>" header per message, then the assistant's turn."""
    parts = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        parts.append(f"<|{m.role}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
