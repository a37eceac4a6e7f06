"""atom: a native inference engine for DeepSeek-V4.1-style models with an LMCache MP tier."""

from atom.config import EngineConfig
from atom.llm import LLM
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
