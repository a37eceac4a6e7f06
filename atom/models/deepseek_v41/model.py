"""DeepSeek-V4.1 for causal LM: modules with HF tensor names, and the paged forward.

The paged forward runs a batch of sequence spans against ONE PAGE pool and per-sequence state
slots, reading and writing nothing else. A span must start where its slot's cursor is (a span
at 0 resets its slot), or, with ``speculative_tokens`` k >= 1, up to k positions behind it, to
re-run positions whose inputs were rejected drafts (exactly: ``paged`` module doc); anything
else is refused before anything is written.

The draft layers (``num_nextn_predict_layers`` of them, ``mtp``; see ``draft``) run through
``forward_draft_paged`` over the same slots, each with its own window ring and cursor.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_api import Span
from atom.models.common.geometry import COMPUTE_DTYPES, INDEX_DTYPES, KV_DTYPES, GeometryError
from atom.models.common.layers import RMSNorm
from atom.models.common.mhc import collapse, identity_pre
from atom.models.common.rope import Angles
from atom.models.common.vocab_parallel import VocabEmbedding, VocabHead
from atom.models.deepseek_v41.block import DecoderLayer
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.draft import DraftLayer, check_draft_spans, forward_draft_paged
from atom.models.deepseek_v41.dspark import DSparkStage
from atom.models.deepseek_v41.engram import EngramHash
from atom.models.deepseek_v41.forward_plan import ForwardPlan
from atom.models.deepseek_v41.paged import PagedKV, StateMismatchError, StateSlots
from atom.models.deepseek_v41.paged_attention import paged_attention


class V41Model(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, kv_dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class DeepseekV41ForCausalLM(nn.Module):
    """The model. ``kv_dtype`` / ``index_dtype`` are the storage types of PAGE rows and window
    rings; the reference forward rounds through the same types."""

    def __init__(
        self,
        config: V41Config,
        *,
        dtype: torch.dtype = torch.float32,
        kv_dtype: str = "fp32",
        index_dtype: str = "fp32",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if dtype not in COMPUTE_DTYPES.values():
            raise GeometryError(f"dtype={dtype} is not supported; use float32 or bfloat16")
        if kv_dtype not in KV_DTYPES:
            raise GeometryError(f"kv_dtype={kv_dtype!r} is not supported; use {list(KV_DTYPES)}")
        if index_dtype not in INDEX_DTYPES:
            raise GeometryError(f"index_dtype={index_dtype!r}; use one of {list(INDEX_DTYPES)}")
        self.config, self.dtype = config, dtype
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        with torch.device(device or "cpu"):
            self.model = V41Model(config, dtype, kv_dtype)
            # the n-gram hashing of the engram layers (None without them)
            spec = config.engram_spec
            self.engram_hash = (
                None if spec is None else EngramHash(spec, config.vocab_size, device or "cpu")
            )
            self.lm_head = VocabHead(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            self.mtp = nn.ModuleList(
                DraftLayer(config, config.num_hidden_layers + i, dtype, kv_dtype)
                for i in range(config.num_nextn_predict_layers)
            )
            self.dspark = nn.ModuleList(
                DSparkStage(config, i, dtype, kv_dtype) for i in range(config.dspark_stages)
            )

    def tp_layers(self) -> dict[str, nn.Module]:
        """The layers tensor parallelism splits (``atom.models.common.tensor_parallel``): every
        main decoder layer's attention and MoE, every Engram table (by columns), the embedding
        and the LM head (by vocabulary; the draft layers and DSpark stages share them); the
        draft layers and DSpark stages themselves stay whole."""
        out: dict[str, nn.Module] = {"model.embed_tokens": self.model.embed_tokens}
        out["lm_head"] = self.lm_head
        for i, layer in enumerate(self.model.layers):
            out[f"model.layers.{i}.self_attn"] = layer.self_attn
            out[f"model.layers.{i}.mlp"] = layer.mlp
            if layer.engram is not None:
                out[f"model.layers.{i}.engram"] = layer.engram
        return out

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def num_draft_layers(self) -> int:
        return len(self.mtp)

    @property
    def draft_block_size(self) -> int:
        """Tokens one DSpark draft proposes (0 without DSpark stages)."""
        return self.config.dspark_block_size if len(self.dspark) else 0

    @torch.no_grad()
    def init_weights(self, seed: int) -> DeepseekV41ForCausalLM:
        """Random weights from a seed (presets without a checkpoint). The draft layers draw
        last, so the main weights do not depend on whether they exist."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        drafts = ("mtp.", "dspark.")
        main = [(n, p) for n, p in self.named_parameters() if not n.startswith(drafts)]
        self._init_params(main, gen)
        self._init_params(self.mtp.named_parameters(prefix="mtp"), gen)
        self._init_params(self.dspark.named_parameters(prefix="dspark"), gen)
        return self

    def _init_params(self, params, gen: torch.Generator) -> None:
        std = self.config.initializer_range
        for name, p in params:
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
                continue
            noise = torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32)
            if name.endswith(("_hc.scale", "q_weight", "k_weight")):  # multipliers, around 1
                p.copy_(1.0 + 0.1 * noise)
                continue
            scale = 0.5 if name.endswith(("attn_sink", "bias", "_hc.base")) else std
            p.copy_(noise * scale)

    # ---- the paged forward ---------------------------------------------------------------

    def check_spans(self, spans: list[Span], slots: StateSlots) -> None:
        """Refuse spans their slot cannot run (``StateSlots.check_start``: at the cursor, or
        behind it within ``speculative_tokens``) before anything is written. Cursors are read
        from the slots' host mirror: no device read (``slots.verify`` also compares the mirror
        with the device)."""
        seen = set()
        if slots.verify:
            _verify_mirror(spans, slots)
        for sp in spans:
            if sp.end <= sp.start:
                raise ValueError(f"empty span [{sp.start}, {sp.end}) for slot {sp.slot}")
            if sp.slot in seen:
                raise ValueError(f"slot {sp.slot} appears twice in one forward")
            seen.add(sp.slot)
            if not 0 <= sp.slot < slots.num_slots:
                raise ValueError(f"slot {sp.slot} out of range [0, {slots.num_slots})")
            if sp.start == 0:
                continue
            tag = slots.host_tag[sp.slot]
            if tag != slots.tag:
                raise StateMismatchError(
                    f"slot {sp.slot} holds no state of this layout (tag {tag:#x}), "
                    f"forward starts at {sp.start}"
                )
            slots.check_start(sp.slot, sp.start)

    @torch.no_grad()
    def forward_paged(
        self,
        token_ids: torch.Tensor,
        spans: list[Span],
        kv: PagedKV,
        slots: StateSlots,
        all_logits: bool = False,
        return_residual: bool = False,
    ):
        """token_ids: int64 [sum of span lengths], spans in order. Returns float32 logits of
        each span's last token [len(spans), V] (or of every token with ``all_logits``); with
        ``return_residual``, (logits, every token's residual): what the drafter reads, the
        last layer's streams [N, hc, d] for the draft layers, or with DSpark stages the target
        hidden [N, targets * d] (``dspark`` module doc).

        No host synchronization: everything the forward indexes with is computed on the host
        from the spans and uploaded in one copy (``ForwardPlan``); the rest is device work."""
        geo = kv.geometry
        if (geo.kv_dtype, geo.index_dtype) != (self.kv_dtype, self.index_dtype):
            raise GeometryError(
                f"pool stores kv={geo.kv_dtype} index={geo.index_dtype}, model was built for "
                f"kv={self.kv_dtype} index={self.index_dtype}"
            )
        if token_ids.numel() != sum(sp.num_tokens for sp in spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        self.check_spans(spans, slots)
        shape = (
            self.config.sliding_window,
            geo.window_rows,
            geo.compressor_rows,
            [r for r in self.config.compress_ratios if r > 0],
        )
        # verify spans (past 0, at most 1 + k tokens) run as decode rows where a spare block
        # takes the writes of rows completing no group: their rows are then a decode step's
        short = 1 if kv.spare_block is None else 1 + slots.speculative_tokens
        plan = ForwardPlan.build(
            token_ids,
            spans,
            self.device,
            shape,
            slots.gram_history.shape[1],
            _frontiers(spans, slots),
            short=short,
            dump_block=kv.spare_block,
        )
        slots.reset_many([sp.slot for sp in spans if sp.start == 0], plan.reset)
        out = self.run_plan(plan, kv, slots, all_logits, return_residual)
        for sp in spans:
            slots.advance(sp.slot, sp.end)
        return out

    @torch.no_grad()
    def run_plan(
        self,
        plan: ForwardPlan,
        kv: PagedKV,
        slots: StateSlots,
        all_logits: bool = False,
        return_residual: bool = False,
    ):
        """The device work of a forward whose spans were checked and whose starting slots were
        reset: no host reads, no host-side state (the slots' host mirror is the caller's). A
        decode graph (``decode_graphs``) captures this with a plan of static tensors."""
        history = slots.gram_history[plan.span_slots]  # [S, H], after the resets
        src = torch.cat([plan.token_ids, history.flatten()])
        grams_t = src[plan.gram_src]
        x = self._embed(plan.token_ids)
        pre = identity_pre(x)
        targets = (
            self.config.dspark_target_layer_ids if return_residual and len(self.dspark) else []
        )
        hidden: list[torch.Tensor] = []
        engram_rows = self.engram_rows(grams_t)  # every engram layer's rows, hashed once
        angles = Angles(plan.positions)  # RoPE angles, once per table for every layer
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            x, pre = layer.block(
                x,
                pre,
                engram_rows,
                lambda u, a=attn: paged_attention(
                    a, u, angles, plan.longer, plan.decode, kv, slots
                ),
                (lambda h: hidden.append(h.mean(dim=1))) if i in targets else None,
            )
        slots.cursor[:, 0].index_copy_(0, plan.span_slots, plan.span_ends)
        slots.cursor[:, 1:].index_copy_(0, plan.span_slots, grams_t[plan.last, 1:])
        slots.header[:, 1].index_copy_(0, plan.span_slots, plan.span_ends)
        if slots.history is not None:
            slots.history[:, 0].index_copy_(0, plan.span_slots, plan.frontiers)
            slots.history[:, 1:].index_copy_(0, plan.span_slots, src[plan.hist_src])
        logits = self._head(x, pre) if all_logits else self._head(x[plan.last], pre[plan.last])
        if hidden:
            return logits, torch.cat(hidden, dim=-1)
        return (logits, x) if return_residual else logits

    def check_draft_spans(self, spans: list[Span], slots: StateSlots, layer: int) -> None:
        """Refuse draft spans draft layer ``layer``'s state cannot continue (``draft``)."""
        check_draft_spans(self, spans, slots, layer)

    @torch.no_grad()
    def forward_draft_paged(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        slots: StateSlots,
        *,
        layer: int = 0,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft layer over spans (``draft.forward_draft_paged``)."""
        return forward_draft_paged(
            self,
            token_ids,
            residual,
            spans,
            slots,
            layer=layer,
            all_logits=all_logits,
            logit_rows=logit_rows,
        )

    def engram_rows(self, grams: torch.Tensor) -> torch.Tensor | None:
        """grams [N, 4] (token ids at t-3 .. t, -1 before the sequence) -> the engram layers'
        row ids [N, engram layers, n_hash_cols], or None without engram layers."""
        return None if self.engram_hash is None else self.engram_hash.rows(grams)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(token_ids)
        return e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def _head(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """float32 logits of streams x [N, hc, d] collapsed with the last FFN's ``pre``."""
        return self.lm_head(self.model.norm(collapse(x, pre))).float()


def _verify_mirror(spans: list[Span], slots: StateSlots) -> None:
    """Debug/test mode: the host mirror of the spans' slots equals the device (a device read)."""
    ids = sorted({sp.slot for sp in spans if 0 <= sp.slot < slots.num_slots})
    for slot, (at, tag) in zip(ids, slots.device_states(ids)):
        mirror = (slots.host_position[slot], slots.host_tag[slot])
        if mirror != (at, tag):
            raise RuntimeError(
                f"slot {slot}: host mirror says position {mirror[0]} tag {mirror[1]:#x}, the "
                f"device says {at} tag {tag:#x}; its bytes were written around StateSlots "
                "(call StateSlots.refresh after writing a slot directly)"
            )
        if slots.history is not None and slots.frontier(slot) != int(slots.history[slot, 0]):
            raise RuntimeError(f"slot {slot}: host mirror's frontier differs from the device")


def _frontiers(spans: list[Span], slots: StateSlots) -> list[int] | None:
    """Each span's slot frontier before the forward (0 for a span at 0), None without
    ``history`` (k = 0: every span starts at its frontier)."""
    if slots.history is None:
        return None
    return [slots.frontier(sp.slot) if sp.start > 0 else 0 for sp in spans]
