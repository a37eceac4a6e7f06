"""OpenAI request fields as clients send them: null meaning "the default", and fields this
server has no feature for, accepted only when they ask for nothing."""

from __future__ import annotations

# OpenAI request fields this server has no feature for: accepted when null or at the value
# that asks for nothing (OpenAI clients send them that way routinely, e.g. tools=None), else
# refused naming the field (a request that wants a tool call or a JSON mode must not be
# answered as if it had not asked).
INERT = {
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "logit_bias": lambda v: v in (None, {}),
    "best_of": lambda v: v in (None, 1),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: v is None or isinstance(v, dict),
    # what routers add to every request they re-serialize (vllm-router, sglang-router: their
    # defaults); atom's detokenizer skips special tokens, trims stops, returns no hidden states
    "skip_special_tokens": lambda v: v in (None, True),
    "no_stop_trim": lambda v: v in (None, False),
    "return_hidden_states": lambda v: v in (None, False),
}


def nulls_and_inert(data):
    """Before validation: a field sent as null means its default (OpenAI's SDK and agent code
    send optional fields as null), and an unsupported OpenAI field is dropped when it asks for
    nothing (``INERT``), refused otherwise."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        if key in INERT:
            if not INERT[key](value):
                raise ValueError(
                    f"{key}: got {value!r}; not supported by this server (no tool calls, "
                    "structured output, logit bias or best_of): send null or leave it out"
                )
            continue
        if value is not None:
            out[key] = value
    return out
