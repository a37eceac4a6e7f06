"""V4.1 as the engine sees it (``atom.model_api.ModelRuntime``): spec, binding, forward, images;
its draft layers (``atom.model_api.DraftRuntime``, see ``draft``) and its DSpark stages
(``atom.model_api.BlockDraftRuntime``, see ``dspark_paged``)."""

from __future__ import annotations

import torch

from atom.model_api import Span, restore_image, store_image
from atom.models.common.draft_layers import DraftLayers
from atom.models.deepseek_v41.decode_graphs import DecodeGraphs
from atom.models.deepseek_v41.dspark_paged import draft_blocks, fill_target_windows
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import PagedKV, StateSlots
from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.span_graphs import SpanGraphs


class V41Runtime(DraftLayers):
    # spans may carry block tables on the host: the forward uploads them with its other indices
    host_block_tables = True
    # with speculative_tokens k >= 1 a forward may start up to k positions behind its slot's
    # cursor (re-running positions whose inputs were rejected drafts; ``paged`` module doc)
    rewinds_on_rejection = True

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
        self.block_size = block_size
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self.max_position = model.config.max_position_embeddings
        self.kv: PagedKV | None = None
        self.slots: StateSlots | None = None
        # blocks and slots the pool and slot bytes hold past the engine's own (the last ones):
        # the decode graphs' padding rows use them (``enable_decode_graphs``)
        self.reserved_blocks = self.reserved_slots = 0
        if self.geometry.speculative_tokens:  # eager verify spans run as decode rows: their
            self.reserved_blocks = 1  # rows completing no group write to the spare block
        self.graphs: DecodeGraphs | None = None
        # verify and draft forwards (speculative_tokens >= 1), with the decode graphs
        self.span_graphs: SpanGraphs | None = None
        self._graph_totals: dict = {}  # graph counts of earlier binds (``graph_stats``)
        self.cuda_graphs = False  # replay decode graphs (once enabled; False: eager, to debug)
        self._graph_args: tuple | None = None

    def enable_decode_graphs(
        self, max_batch: int, max_len: int | None = None, backend=None
    ) -> bool:
        """Replay CUDA graphs for decode forwards of up to ``max_batch`` spans (CUDA only; on
        another device nothing changes and this returns False, unless a test passes a
        ``backend``: see ``decode_graphs``). Call before the pool is allocated: whoever
        allocates it then adds ``reserved_blocks`` blocks and ``reserved_slots`` slots at the
        end, which the graphs' padding rows read and write. ``cuda_graphs`` turns the replays
        off and on afterwards. With ``speculative_tokens`` k >= 1 the verify and draft
        forwards replay graphs too (``span_graphs``: up to ``max_batch * (k + 1)`` rows)."""
        if self.device.type != "cuda" and backend is None:
            return False
        self.reserved_blocks = self.reserved_slots = 1
        self._graph_args = (max_batch, max_len or self.max_position, backend)
        self.cuda_graphs = True
        return True

    def bind(self, pool: torch.Tensor, slot_bytes: torch.Tensor) -> None:
        self.pool, self.slot_bytes = pool, slot_bytes
        self.kv = PagedKV(self.geometry, pool)
        if self.reserved_blocks:
            self.kv.spare_block = pool.shape[0] - 1
        self.slots = StateSlots(self.geometry, slot_bytes)
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
                self.span_graphs = SpanGraphs(
                    self.model, self.kv, self.slots, max_rows=rows, **common
                )
            self.graphs = DecodeGraphs(
                self.model, self.kv, self.slots, max_batch=max_batch, **common
            )

    def forward(self, token_ids: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        if self.cuda_graphs and self.graphs is not None:
            logits = self.graphs.run(token_ids, spans)
            if logits is not None:
                return logits
        return self.model.forward_paged(token_ids, spans, self.kv, self.slots)

    def graph_stats(self) -> dict:
        """Per kind of CUDA graph (decode; verify and draft with drafts): graphs captured, their
        replays, and captures that failed (those shapes run eagerly), replays and failures
        counted over every ``bind``. Empty without graphs."""
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

    # (atom.model_api.DraftRuntime, the draft layers: ``DraftLayers``)

    # ---- atom.model_api.BlockDraftRuntime: DSpark -----------------------------------------

    @property
    def draft_block_size(self) -> int:
        return self.model.draft_block_size

    def fill_draft_windows(self, residual: torch.Tensor, spans: list[Span]) -> None:
        fill_target_windows(self.model, residual, spans, self.slots)

    def draft_blocks(
        self, tokens: list[int], positions: list[int], slots: list[int]
    ) -> list[list[int]]:
        ids, _, _ = draft_blocks(self.model, tokens, positions, slots, self.slots)
        return ids.tolist()

    def store_image(self, slot: int, units: torch.Tensor) -> None:
        store_image(self.spec, self.pool, self.slot_bytes, slot, units)

    def restore_image(self, units: torch.Tensor, slot: int) -> int:
        restore_image(self.spec, self.pool, self.slot_bytes, units, slot)
        self.slots.refresh(slot)  # the image's cursor into the host mirror (one device read)
        return self.slots.position(slot)
