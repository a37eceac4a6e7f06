"""The Python API: ``LLM(model, **engine config).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from atom.builder import build_engine
from atom.config import EngineConfig
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.tokenizer import load_tokenizer

Prompt = str | list[int]


class LLM:
    """An offline engine. ``model`` is a preset (v41-tiny, v41-mini, v41-bench) or a directory
    with config.json and safetensors; keyword arguments are EngineConfig fields, plus
    ``lmcache_url``: with ``offload="lmcache_mp"``, None starts and owns a local LMCache
    server, a URL connects to that one."""

    def __init__(
        self,
        model: str = "v41-mini",
        config: EngineConfig | None = None,
        lmcache_url: str | None = None,
        **kw: Any,
    ):
        if lmcache_url is not None:
            kw.setdefault("offload", "lmcache_mp")
            kw["lmcache"] = {**dict(kw.get("lmcache", {})), "url": lmcache_url}
        if config is None:
            config = EngineConfig.build(model=model, **kw)
        elif kw:
            config = EngineConfig.build(**{**config.model_dump(), **kw})
        self.engine = build_engine(config)
        self.tokenizer = load_tokenizer(config.model)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        on_step=None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self.encode(p) for p in prompts]
        seqs = [
            self.engine.add_request(ids, p, eos_token_id=self.tokenizer.eos_token_id)
            for ids, p in zip(encoded, params)
        ]
        self.engine.run_until(lambda: all(s.is_finished for s in seqs), on_step)
        return [RequestOutput.from_sequence(s, self.tokenizer.decode(s.output)) for s in seqs]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
