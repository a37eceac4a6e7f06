"""How the server turns chat messages into one prompt: ``render_chat`` (what
/v1/chat/completions and /tokenize apply) and ``CHAT_TEMPLATE``, the same rendering as a Jinja
template (what /tokenizer_info and the shipped tokenizer directory publish, so that a client
applying the template sends exactly the prompt the server would render)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Message(Protocol):
    role: str
    name: str | None

    @property
    def text(self) -> str: ...


GENERATION_PROMPT = "<|assistant|>\n"

# Contract: rendered with ``messages`` (OpenAI's dicts: role, content as a string, a list of
# text parts or null, optional name) and ``add_generation_prompt``, it equals render_chat.
# Newlines are Jinja string literals, so trim_blocks/lstrip_blocks (transformers') change nothing.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] }}{% if m['name'] %}{{ ' name=' + m['name'] }}{% endif %}{{ '|>\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """A plain chat template: one "<|role|>" header per message (``<|role name=N|>`` when the
    message has a ``name``), then, with ``add_generation_prompt``, the assistant's turn."""
    parts = []
    for m in messages:
        head = m.role if m.name is None else f"{m.role} name={m.name}"
        parts.append(f"<|{head}|>\n{m.text}\n")
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)
