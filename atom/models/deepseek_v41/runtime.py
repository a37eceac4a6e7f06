"""V4.1 as the engine sees it (``atom.model_api.ModelRuntime``): spec, binding, forward, images."""

from __future__ import annotations

import torch

from atom.model_api import Span, restore_image, store_image
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import PagedKV, StateSlots
from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry


class V41Runtime:
    # spans may carry block tables on the host: the forward uploads them with its other indices
    host_block_tables = True

    def __init__(
        self, model: DeepseekV41ForCausalLM, *, block_size: int, speculative_tokens: int = 0
    ):
        self.model = model
        self.geometry = build_v41_pool_geometry(
            model.config,
            kv_dtype=model.kv_dtype,
            index_dtype=model.index_dtype,
            block_size=block_size,
            speculative_tokens=speculative_tokens,
        )
        self.spec = self.geometry.state_spec()
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self.max_position = model.config.max_position_embeddings
        self.kv: PagedKV | None = None
        self.slots: StateSlots | None = None

    def bind(self, pool: torch.Tensor, slot_bytes: torch.Tensor) -> None:
        self.pool, self.slot_bytes = pool, slot_bytes
        self.kv = PagedKV(self.geometry, pool)
        self.slots = StateSlots(self.geometry, slot_bytes)

    def forward(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        return self.model.forward_paged(token_ids, spans, self.kv, self.slots)

    def store_image(self, slot: int, units: torch.Tensor) -> None:
        store_image(self.spec, self.pool, self.slot_bytes, slot, units)

    def restore_image(self, units: torch.Tensor, slot: int) -> int:
        restore_image(self.spec, self.pool, self.slot_bytes, units, slot)
        self.slots.refresh(slot)  # the image's cursor into the host mirror (one device read)
        return self.slots.position(slot)
