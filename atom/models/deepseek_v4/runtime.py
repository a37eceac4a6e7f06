"""V4 as the engine sees it (``atom.model_api.ModelRuntime``): spec, binding, forward, images;
and its MTP blocks as draft layers (``atom.model_api.DraftRuntime``).

Images are byte copies of the state slot, exactly as for V4.1. The live scratch (each
compressor's current, incomplete group) stays with the runtime: images are only taken and
restored at block boundaries, where every group is complete, so ``restore_image`` refuses an
image whose position is off that grid rather than resume with a stale partial group.
"""

from __future__ import annotations

import math

import torch

from atom.model_api import Span, image_header, restore_image, store_image
from atom.models.common.draft_layers import DraftLayers
from atom.models.deepseek_v4.decode_graphs import V4DecodeGraphs
from atom.models.deepseek_v4.geometry import build_v4_pool_geometry
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.paged import StateMismatchError, V4PagedKV, V4StateSlots
from atom.models.deepseek_v4.span_graphs import V4SpanGraphs


class V4Runtime(DraftLayers):
    # spans may carry block tables on the host (the batched decode builds its indices there)
    host_block_tables = True
    # with speculative_tokens k, a forward may start up to k positions behind the cursor (the
    # rings keep what rejected drafts overwrote: ``geometry`` module doc)
    rewinds_on_rejection = True

    def __init__(
        self, model: DeepseekV4ForCausalLM, *, block_size: int, speculative_tokens: int = 0
    ):
        self.model = model
        self.geometry = build_v4_pool_geometry(
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
        ratios = [r for r in model.config.compress_ratios if r] or [1]
        self.group_grid = math.lcm(*ratios)
        self.block_size = block_size
        self.kv: V4PagedKV | None = None
        self.slots: V4StateSlots | None = None
        # blocks and slots past the engine's own (the last ones), for the decode graphs'
        # padding rows (``enable_decode_graphs``)
        self.reserved_blocks = self.reserved_slots = 0
        self.graphs: V4DecodeGraphs | None = None
        self.span_graphs: V4SpanGraphs | None = None  # verify forwards, with drafts
        self.cuda_graphs = False  # replay decode graphs (once enabled; False: eager, to debug)
        self._graph_args: tuple | None = None
        self._graph_totals: dict = {}  # per kind, of earlier binds

    def enable_decode_graphs(
        self, max_batch: int, max_len: int | None = None, backend=None
    ) -> bool:
        """Replay CUDA graphs for decode forwards of up to ``max_batch`` spans (CUDA only;
        elsewhere nothing changes and this returns False, unless a test passes a ``backend``,
        ``atom.models.common.graphs.EagerBackend``). Call before the pool is allocated: its
        allocator adds ``reserved_blocks`` blocks and ``reserved_slots`` slots at the end,
        which the padding rows use. ``cuda_graphs`` turns the replays off and on afterwards."""
        if self.device.type != "cuda" and backend is None:
            return False
        self.reserved_blocks = self.reserved_slots = 1
        self._graph_args = (max_batch, max_len or self.max_position, backend)
        self.cuda_graphs = True
        return True

    def bind(self, pool: torch.Tensor, slot_bytes: torch.Tensor) -> None:
        self.pool, self.slot_bytes = pool, slot_bytes
        self.kv = V4PagedKV(self.geometry, pool)
        self.slots = V4StateSlots(self.geometry, slot_bytes)
        self._graph_totals = self.graph_stats()  # counts so far (a counter never goes down)
        self.graphs = self.span_graphs = None
        if self._graph_args is not None:
            max_batch, max_len, backend = self._graph_args
            common = dict(
                block_size=self.block_size,
                spare_slot=slot_bytes.shape[0] - 1,
                spare_block=pool.shape[0] - 1,
                max_blocks=-(-max_len // self.block_size),
                backend=backend,
            )
            k = self.geometry.speculative_tokens
            if k:
                rows = max_batch * (k + 1)
                self.span_graphs = V4SpanGraphs(
                    self.model, self.kv, self.slots, max_rows=rows, **common
                )
            self.graphs = V4DecodeGraphs(
                self.model, self.kv, self.slots, max_batch=max_batch, **common
            )

    def forward(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        if self.cuda_graphs and self.graphs is not None:
            logits = self.graphs.run(token_ids, spans)
            if logits is not None:
                return logits
        return self.model.forward_paged(token_ids, spans, self.kv, self.slots)

    def graph_stats(self) -> dict:
        """Per kind of CUDA graph (decode; verify with drafts): graphs captured, their replays
        and captures that failed (those shapes run eagerly), replays and failures counted over
        every ``bind``. Empty without graphs."""
        out = {}
        if self.graphs is not None:
            g = self.graphs
            out["decode"] = {
                "captured": len(g.graphs),
                "replays": g.replays,
                "failed": len(g.failed),
            }
        if self.span_graphs is not None:
            g = self.span_graphs
            for kind in ("verify", "draft"):
                out[kind] = {
                    "captured": sum(key[0] == kind for key in g.graphs),
                    "replays": g.replays[kind],
                    "failed": sum(key[0] == kind for key in g.failed),
                }
        for kind, before in self._graph_totals.items():
            now = out.setdefault(kind, {"captured": 0, "replays": 0, "failed": 0})
            now["replays"] += before["replays"]
            now["failed"] += before["failed"]
        return out

    # (atom.model_api.DraftRuntime, the MTP blocks: ``DraftLayers``)

    def store_image(self, slot: int, units: torch.Tensor) -> None:
        store_image(self.spec, self.pool, self.slot_bytes, slot, units)

    def restore_image(self, units: torch.Tensor, slot: int) -> int:
        tag, at = image_header(self.spec, self.pool, units)
        if tag == self.spec.layout_tag and at % self.group_grid:  # another layout: refused below
            raise StateMismatchError(
                f"image at position {at} is off the compressors' group grid ({self.group_grid}); "
                "only block-boundary images can be restored"
            )
        restore_image(self.spec, self.pool, self.slot_bytes, units, slot)
        self.slots.refresh(slot)  # the image's cursor into the host mirror (one device read)
        return self.slots.host_position[slot]
