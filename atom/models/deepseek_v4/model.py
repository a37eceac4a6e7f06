"""DeepSeek-V4 for causal LM: modules (named after DeepSeek's tensors) and the paged forward.

The paged forward runs a batch of sequence spans against ONE PAGE pool and per-sequence state
slots (plus the runtime's live scratch, see ``paged``). A span must start where its slot's
cursor is (a span at 0 resets its slot); any mismatch is refused before anything is written.

The MTP draft blocks (``mtp.{i}.*``, ``num_nextn_predict_layers`` of them, see ``mtp``) run
through ``forward_draft_paged`` over the same slots: each has its own window ring (the state's
window rows ``num_hidden_layers + i``, present when the geometry has ``speculative_tokens`` >= 1)
and its own cursor (``draft_cursor``); it never touches PAGE or the target layers' state.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_api import Span
from atom.models.common.geometry import COMPUTE_DTYPES, INDEX_DTYPES, KV_DTYPES, GeometryError
from atom.models.common.layers import RMSNorm
from atom.models.common.vocab_parallel import VocabEmbedding, VocabHead
from atom.models.deepseek_v4.block import V4Block
from atom.models.deepseek_v4.config import V4Config
from atom.models.deepseek_v4.forward_plan import V4ForwardPlan
from atom.models.deepseek_v4.layers import V4HyperConnection
from atom.models.deepseek_v4.mtp import V4MTPBlock
from atom.models.deepseek_v4.paged import StateMismatchError, V4PagedKV, V4StateSlots
from atom.models.deepseek_v4.paged_attention import paged_attention
from atom.models.deepseek_v4.paged_decode import DecodeBatch, decode_attention


class DeepseekV4ForCausalLM(nn.Module):
    """The model. ``kv_dtype`` / ``index_dtype`` are the storage types of PAGE rows and window
    rings; the oracle rounds through the same types."""

    def __init__(
        self,
        config: V4Config,
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
        c = config
        with torch.device(device or "cpu"):
            self.embed = VocabEmbedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                V4Block(c, i, dtype, kv_dtype) for i in range(c.num_hidden_layers)
            )
            self.hc_head = V4HyperConnection(c, head=True)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.head = VocabHead(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
            self.mtp = nn.ModuleList(
                V4MTPBlock(c, i, dtype, kv_dtype) for i in range(c.num_nextn_predict_layers)
            )

    def tp_layers(self) -> dict[str, nn.Module]:
        """The layers tensor parallelism splits (``atom.models.common.tensor_parallel``): every
        main block's attention and MoE, the embedding and the head (by vocabulary; the MTP
        blocks share them); the MTP blocks themselves stay whole."""
        out: dict[str, nn.Module] = {"embed": self.embed, "head": self.head}
        for i, block in enumerate(self.layers):
            out[f"layers.{i}.attn"] = block.attn
            out[f"layers.{i}.ffn"] = block.ffn
        return out

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def num_draft_layers(self) -> int:
        return len(self.mtp)

    @torch.no_grad()
    def init_weights(self, seed: int) -> DeepseekV4ForCausalLM:
        """Random weights from a seed (presets without a checkpoint). The MTP blocks draw last,
        so the main model's weights do not depend on whether they exist."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        main = [(n, p) for n, p in self.named_parameters() if not n.startswith("mtp.")]
        self._init_params(main, gen)
        e, k = self.config.n_routed_experts, self.config.num_experts_per_tok
        for name, buf in self.named_buffers():
            if name.endswith("tid2eid"):
                ranks = torch.rand(buf.shape[0], e, generator=gen, device=self.device)
                buf.copy_(ranks.argsort(-1)[:, :k])
        self._init_params(self.mtp.named_parameters(prefix="mtp"), gen)
        return self

    def _init_params(self, params, gen: torch.Generator) -> None:
        std = self.config.initializer_range
        for name, p in params:
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            noise = torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32)
            if name.endswith(".scale"):
                p.copy_(1.0 + 0.1 * noise)
                continue
            scale = 0.5 if name.endswith(("attn_sink", "bias", ".base", ".ape")) else std
            p.copy_(noise * scale)

    # ---- the paged forward ---------------------------------------------------------------

    @staticmethod
    def _check_span_set(spans: list[Span], slots: V4StateSlots) -> None:
        seen = set()
        for sp in spans:
            if sp.end <= sp.start:
                raise ValueError(f"empty span [{sp.start}, {sp.end}) for slot {sp.slot}")
            if sp.slot in seen:
                raise ValueError(f"slot {sp.slot} appears twice in one forward")
            seen.add(sp.slot)
            if not 0 <= sp.slot < slots.num_slots:
                raise ValueError(f"slot {sp.slot} out of range [0, {slots.num_slots})")

    def check_spans(self, spans: list[Span], slots: V4StateSlots) -> None:
        """Refuse spans their slot cannot run (``V4StateSlots.check_start``: at the cursor, or
        behind it within ``speculative_tokens``) before anything is written. Cursors come from
        the slots' host mirror: no device read."""
        self._check_span_set(spans, slots)
        for sp in spans:
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
        kv: V4PagedKV,
        slots: V4StateSlots,
        all_logits: bool = False,
        return_residual: bool = False,
    ):
        """token_ids: int64 [sum of span lengths], spans in order. Returns float32 logits of
        each span's last token [len(spans), V] (or of every token with ``all_logits``); with
        ``return_residual``, (logits, the last layer's streams of every token [N, hc, d]):
        the residual the MTP draft layers read."""
        geo = kv.geometry
        if (geo.kv_dtype, geo.index_dtype) != (self.kv_dtype, self.index_dtype):
            raise GeometryError(
                f"pool stores kv={geo.kv_dtype} index={geo.index_dtype}, model was built for "
                f"kv={self.kv_dtype} index={self.index_dtype}"
            )
        if token_ids.numel() != sum(sp.num_tokens for sp in spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        self.check_spans(spans, slots)
        if DecodeBatch.usable(spans):  # every span one token: batched (``paged_decode``)
            batch = DecodeBatch.build(
                spans, token_ids, device=self.device, **self.decode_layout(slots)
            )
            x = self.decode_streams(batch, kv, slots)
            for sp in spans:
                slots.advance(sp.slot, sp.end)
            logits = self.logits(x)
            return (logits, x) if return_residual else logits
        short = 1 + slots.geometry.speculative_tokens  # verify spans run as decode rows
        layout = self.decode_layout(slots)
        plan = V4ForwardPlan.build(token_ids, spans, self.device, short=short, **layout)
        slots.reset_many([sp.slot for sp in spans if sp.start == 0], plan.reset)
        x = self.embed_streams(plan.token_ids)
        for layer in self.layers:
            attn = layer.attn
            x = layer(x, plan.token_ids, lambda u, a=attn: paged_attention(a, u, plan, kv, slots))
        slots.cursor[plan.span_slots, 0] = plan.span_ends
        slots.header[plan.span_slots, 1] = plan.span_ends
        for sp in spans:
            slots.advance(sp.slot, sp.end)
        logits = self.logits(x if all_logits else x[plan.last])
        return (logits, x) if return_residual else logits

    def decode_layout(self, slots: V4StateSlots) -> dict:
        """What ``DecodeBatch`` (and ``V4ForwardPlan``) need of the model and state: ratios,
        window, ring rows."""
        c, geo = self.config, slots.geometry
        ratios = [r for r in c.compress_ratios[: c.num_hidden_layers] if r]
        return dict(
            ratios=ratios,
            partial={r: geo.partial_rows(r) for r in set(ratios)},
            entries=geo.overlap_entries,
        ) | self._window(slots)

    def _window(self, slots: V4StateSlots) -> dict:
        return dict(window=self.config.sliding_window, ring=slots.geometry.window_rows)

    @torch.no_grad()
    def decode_streams(self, batch: DecodeBatch, kv: V4PagedKV, slots: V4StateSlots):
        """The layers over a decode batch -> the last layer's streams [B, hc, d]; writes the
        state and PAGE rows and the slots' cursors on the device (not the host mirror). No host
        read: the decode graphs capture this."""
        x = self.embed_streams(batch.ids)
        for layer in self.layers:
            attn = layer.attn
            x = layer(x, batch.ids, lambda u, a=attn: decode_attention(a, u, batch, kv, slots))
        # every row of a span writes its span's end (rows sharing a slot: the same value)
        slots.cursor[batch.slots, 0] = batch.ends
        slots.header[batch.slots, 1] = batch.ends
        return x

    # ---- the MTP draft layers ------------------------------------------------------------

    def check_draft_spans(self, spans: list[Span], slots: V4StateSlots, layer: int) -> None:
        """Refuse draft spans the draft layer's state cannot continue (before any write): a
        span at s > 0 needs the draft's window of [s - window, s), so its cursor must be in
        [s, s + speculative_tokens] (it may rewind over rejected drafts, no further)."""
        if not 0 <= layer < len(self.mtp):
            raise ValueError(f"draft layer {layer} out of range [0, {len(self.mtp)})")
        geo = slots.geometry
        if slots.draft_cursor is None or geo.state_layers <= self.mtp[layer].layer:
            raise GeometryError(
                "the state has no window ring for the MTP draft layers: build the runtime "
                "with speculative_tokens >= 1"
            )
        self._check_span_set(spans, slots)
        k = geo.speculative_tokens
        for sp in spans:
            if sp.start == 0:
                continue
            tag, at = slots.host_tag[sp.slot], slots.host_draft[sp.slot][layer]
            if tag != slots.tag:
                raise StateMismatchError(
                    f"slot {sp.slot} holds no state of this layout (tag {tag:#x}), "
                    f"draft forward starts at {sp.start}"
                )
            if not sp.start <= at <= sp.start + k:
                raise StateMismatchError(
                    f"slot {sp.slot}: draft layer {layer} is at {at}, a draft forward at "
                    f"{sp.start} needs it in [{sp.start}, {sp.start + k}] "
                    f"(speculative_tokens={k})"
                )

    @torch.no_grad()
    def forward_draft_paged(
        self,
        token_ids: torch.Tensor,
        residual: torch.Tensor,
        spans: list[Span],
        slots: V4StateSlots,
        *,
        layer: int = 0,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft layer over spans (contract: ``atom.model_api.DraftRuntime``).

        token_ids int64 [N] (for each position p of the spans, the token at p + 1), residual
        [N, hc, d] (the streams at p: ``forward_paged(..., return_residual=True)``'s, or a
        previous draft call's when chaining). Returns (float32 logits [len(spans), V] of each
        span's last position (of the rows ``logit_rows`` [len(spans)] names instead, when
        given), or [N, V] with ``all_logits``, predicting the token at p + 2;
        the draft's output streams [N, hc, d]). Writes only the layer's window ring and its
        cursor in each slot."""
        c = self.config
        if token_ids.numel() != sum(sp.num_tokens for sp in spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        if tuple(residual.shape) != (token_ids.numel(), c.hc_mult, c.hidden_size):
            raise ValueError(
                f"residual must be [{token_ids.numel()}, {c.hc_mult}, {c.hidden_size}], "
                f"got {list(residual.shape)}"
            )
        self.check_draft_spans(spans, slots, layer)
        short = 1 + slots.geometry.speculative_tokens  # verify-sized spans as decode rows
        layout = self._window(slots)
        plan = V4ForwardPlan.build(token_ids, spans, self.device, ratios=[], short=short, **layout)
        ids, block = plan.token_ids, self.mtp[layer]
        x = block.draft(
            self.embed(ids),
            residual.to(self.device),
            ids,
            lambda u: paged_attention(block.attn, u, plan, None, slots),
        )
        slots.draft_cursor[plan.span_slots, layer] = plan.span_ends
        for sp in spans:
            slots.advance_draft(sp.slot, layer, sp.end)
        if all_logits:
            return block.logits(x, self.head), x
        rows = plan.last if logit_rows is None else logit_rows.to(x.device)
        return block.logits(x[rows], self.head), x

    def embed_streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(token_ids)
        return e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.hc_head.pre(x)
        return self.head(self.norm(h)).float()
