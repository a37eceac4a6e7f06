"""OpenAI-compatible request bodies. Unknown fields are refused (HTTP 400), never ignored.

Every refusal names the field, the value and what is allowed; ``app.py`` turns pydantic's
errors into OpenAI's error JSON.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from atom.sampling_params import MAX_LOGPROBS, SamplingParams
from atom.serve.chat_template import render_chat
from atom.serve.openai_fields import nulls_and_inert

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_CHOICES = 1024  # choices per request: prompts x n


def check_text(value: str, what: str = "text") -> str:
    """Refuse a string that is not valid Unicode (a lone surrogate such as "\\ud800", which
    JSON's \\u escapes can carry) before it reaches the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end]
        raise ValueError(
            f"{what}: contains a lone surrogate {bad!r} at index {exc.start}; "
            "text must be valid Unicode (encodable as UTF-8)"
        ) from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # the usage so far in every chunk (vLLM)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data):
        return nulls_and_inert(data)

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
    repetition_penalty: float = 1.0  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"got {v}; allowed: an integer in [1, {MAX_N}]")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if not -2 <= v <= 2:  # also refuses NaN
            raise ValueError(f"got {v}; allowed: a number in [-2, 2] (0 = off)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"got {v}; allowed: a finite number > 0 (1 = off)")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"got {v}; allowed: an integer >= 0 (0 = off)")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"got {v}; max_tokens must be >= 1 (or omitted; 0 only with echo)")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"got {v}; allowed: a finite number >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:  # also refuses NaN
            raise ValueError(f"got {v}; allowed: 0 < top_p <= 1 (1 = off)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"got {v}; allowed: an integer >= 0 (0 = off)")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_RANGE[0] <= v <= SEED_RANGE[1]:
            raise ValueError(f"got {v}; allowed: an integer in [-2**63, 2**64 - 1]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"got {bad[:5]}; token ids must be >= 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if s == "":
                raise ValueError(
                    "got ''; an empty stop string would match at once: send non-empty strings"
                )
            check_text(s, "stop string")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        if self.max_tokens == 0 and not self.echo_only_allowed:
            raise ValueError("max_tokens: got 0; must be >= 1 (or omitted; 0 only with echo)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: got {self.min_tokens}; must be <= max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def echo_only_allowed(self) -> bool:
        """max_tokens 0 is allowed (completions with echo: the prompt only)."""
        return False

    @property
    def echo_only(self) -> bool:
        return False

    def _logprobs(self) -> tuple[int | None, int | None]:
        """Alternatives the engine records per generated token (None: no logprobs), and per
        prompt token (None: no prompt logprobs)."""
        return None, None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def usage_every_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def usage_at_end(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, default_max_tokens: int | None, index: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``index`` (of ``n``): with a seed, choice i
        samples with seed + i, so the choices differ and each is reproducible."""
        logprobs, prompt_logprobs = self._logprobs()
        seed = self.seed
        if seed is not None and index:
            seed += index
            if seed > SEED_RANGE[1]:
                seed -= 2**64
        # not given: --default-max-tokens, or (None) what fits max_model_len and the pool
        # once SamplingParams accepts None; until then the server's default applies.
        return SamplingParams(
            # max_tokens 0 (echo only): one token is sampled and not returned (as vLLM)
            max_tokens=(
                max(self.max_tokens, 1) if self.max_tokens is not None else default_max_tokens
            ),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @property
    def echo_only_allowed(self) -> bool:
        return self.echo

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) only, as likelihood-evaluation
        harnesses ask."""
        return self.echo and self.max_tokens == 0

    def _logprobs(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list, or a list of them (OpenAI's
        batched prompts; choice i * n + j is prompt i's j-th)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @model_validator(mode="after")
    def _prompt_list(self) -> CompletionRequest:
        prompts = self.prompts
        if not prompts or any(len(p) == 0 for p in prompts if not isinstance(p, str)):
            raise ValueError("prompt: got an empty list; send a string, token ids, or a list")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"prompt: {len(prompts)} prompts x n={self.n} is more than {MAX_CHOICES} "
                "choices in one request; split the prompts over several requests"
            )
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                check_text(p, "prompt" if len(prompts) == 1 else f"prompt {i}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs: got {self.logprobs}; allowed: an integer in [0, {MAX_LOGPROBS}] "
                "(alternatives per token) or null"
            )
        if self.suffix:
            raise ValueError("suffix: suffix is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = ""
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[dict] | None) -> str | list[dict] | None:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f"part {i} has type {kind!r}; only text parts are supported "
                        "(this model reads no images or audio)"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: a text part needs a string 'text'")
                check_text(part["text"], f"part {i}")
        elif isinstance(v, str):
            check_text(v, "content")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None:
            check_text(v, "name")
            if not v or any(c in v for c in "|<>\n"):
                raise ValueError(
                    f"got {v!r}; a name is non-empty without '|', '<', '>' or newlines"
                )
        return v

    @property
    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p["text"] for p in c)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _logprobs(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    @model_validator(mode="after")
    def _max(self) -> ChatCompletionRequest:
        mct = self.max_completion_tokens
        if mct is not None:
            if mct <= 0:
                raise ValueError(f"max_completion_tokens: got {mct}; must be >= 1 (or omitted)")
            if self.max_tokens is not None and self.max_tokens != mct:
                raise ValueError(
                    f"max_tokens ({self.max_tokens}) and max_completion_tokens ({mct}) differ; "
                    "send one of them (max_tokens is the deprecated name)"
                )
            self.max_tokens = mct
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"top_logprobs: got {self.top_logprobs}; allowed: an integer in "
                    f"[0, {MAX_LOGPROBS}]"
                )
            if not self.logprobs:
                raise ValueError("top_logprobs: needs logprobs=true")
        for i, m in enumerate(self.messages):
            if m.role == "user" and not m.text:
                raise ValueError(f"messages.{i}.content: a user message must not be empty")
        return self


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.prompt is not None:
            check_text(self.prompt, "prompt")
        return self

    def text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return render_chat(self.messages, self.add_generation_prompt)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
