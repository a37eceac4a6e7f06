"""DeepSeek-V4 for causal LM: modules (named after DeepSeek's tensors) and the paged forward.

The paged forward runs a batch of sequence spans against ONE PAGE pool and per-sequence state
slots (plus the runtime's live scratch, see ``paged``). A span must start where its slot's
cursor is (a span at 0 resets its slot); any mismatch is refused before anything is written.
The MTP draft block (``mtp.0.*``) is not built here.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_api import Span
from atom.models.deepseek_v4.attention import V4Attention
from atom.models.deepseek_v4.config import V4Config
from atom.models.deepseek_v4.layers import V4HyperConnection, V4MoE
from atom.models.deepseek_v4.paged import StateMismatchError, V4PagedKV, V4StateSlots
from atom.models.deepseek_v4.paged_attention import paged_attention
from atom.models.deepseek_v41.layers import RMSNorm
from atom.models.deepseek_v41.model import COMPUTE_DTYPES
from atom.models.deepseek_v41.paged_attention import SeqCarry
from atom.models.deepseek_v41.pool_geometry import INDEX_DTYPES, KV_DTYPES, GeometryError


class V4Block(nn.Module):
    def __init__(self, config: V4Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.hc_attn = V4HyperConnection(config)
        self.attn_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.attn = V4Attention(config, layer, dtype, kv_dtype)
        self.hc_ffn = V4HyperConnection(config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps, dtype)
        self.ffn = V4MoE(config, layer, dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, attend) -> torch.Tensor:
        """One layer around an attention callable ``attend(normed input) -> output``; the MoE
        reads the token ids (hash-routed layers)."""
        h, post, c = self.hc_attn.pre(x)
        x = self.hc_attn.post(x, attend(self.attn_norm(h)), post, c)
        h, post, c = self.hc_ffn.pre(x)
        return self.hc_ffn.post(x, self.ffn(self.ffn_norm(h), token_ids), post, c)


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
            self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                V4Block(c, i, dtype, kv_dtype) for i in range(c.num_hidden_layers)
            )
            self.hc_head = V4HyperConnection(c, head=True)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @torch.no_grad()
    def init_weights(self, seed: int) -> DeepseekV4ForCausalLM:
        """Random weights from a seed (presets without a checkpoint)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            noise = torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32)
            if name.endswith(".scale"):
                p.copy_(1.0 + 0.1 * noise)
                continue
            scale = 0.5 if name.endswith(("attn_sink", "bias", ".base", ".ape")) else std
            p.copy_(noise * scale)
        e, k = self.config.n_routed_experts, self.config.num_experts_per_tok
        for name, buf in self.named_buffers():
            if name.endswith("tid2eid"):
                ranks = torch.rand(buf.shape[0], e, generator=gen, device=self.device)
                buf.copy_(ranks.argsort(-1)[:, :k])
        return self

    # ---- the paged forward ---------------------------------------------------------------

    def check_spans(self, spans: list[Span], slots: V4StateSlots) -> None:
        """Refuse spans whose start is not their slot's cursor (before anything is written)."""
        seen = set()
        for sp in spans:
            if sp.end <= sp.start:
                raise ValueError(f"empty span [{sp.start}, {sp.end}) for slot {sp.slot}")
            if sp.slot in seen:
                raise ValueError(f"slot {sp.slot} appears twice in one forward")
            seen.add(sp.slot)
            if not 0 <= sp.slot < slots.num_slots:
                raise ValueError(f"slot {sp.slot} out of range [0, {slots.num_slots})")
        resumed = [sp for sp in spans if sp.start > 0]
        if not resumed:
            return
        ids = [sp.slot for sp in resumed]
        states = torch.stack([slots.cursor[ids, 0], slots.header[ids, 0]], 1).tolist()
        for sp, (at, tag) in zip(resumed, states):
            if tag != slots.tag:
                raise StateMismatchError(
                    f"slot {sp.slot} holds no state of this layout (tag {tag:#x}), "
                    f"forward starts at {sp.start}"
                )
            if at != sp.start:
                raise StateMismatchError(
                    f"slot {sp.slot}: state is at {at}, forward starts at {sp.start}"
                )

    @torch.no_grad()
    def forward_paged(
        self,
        token_ids: torch.Tensor,
        spans: list[Span],
        kv: V4PagedKV,
        slots: V4StateSlots,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """token_ids: int64 [sum of span lengths], spans in order. Returns float32 logits of
        each span's last token [len(spans), V] (or of every token with ``all_logits``)."""
        geo = kv.geometry
        if (geo.kv_dtype, geo.index_dtype) != (self.kv_dtype, self.index_dtype):
            raise GeometryError(
                f"pool stores kv={geo.kv_dtype} index={geo.index_dtype}, model was built for "
                f"kv={self.kv_dtype} index={self.index_dtype}"
            )
        if token_ids.numel() != sum(sp.num_tokens for sp in spans):
            raise ValueError("token_ids must hold exactly the spans' tokens, in span order")
        self.check_spans(spans, slots)
        dev = self.device
        token_ids = token_ids.to(dev)
        seqs, lo, positions = [], 0, []
        for sp in spans:
            if sp.start == 0:
                slots.reset(sp.slot)
            pos = torch.arange(sp.start, sp.end, device=dev)
            seqs.append(SeqCarry(sp, lo, pos))
            positions.append(pos)
            lo += sp.num_tokens
        pos_t = torch.cat(positions)
        x = self.embed_streams(token_ids)
        for layer in self.layers:
            attn = layer.attn
            x = layer(x, token_ids, lambda u, a=attn: paged_attention(a, u, pos_t, seqs, kv, slots))
        for seq in seqs:
            slots.cursor[seq.span.slot, 0] = seq.span.end
            slots.header[seq.span.slot, 1] = seq.span.end
        if not all_logits:
            x = x[torch.tensor([s.hi - 1 for s in seqs], device=dev)]
        return self.logits(x)

    def embed_streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(token_ids)
        return e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.hc_head.pre(x)
        return self.head(self.norm(h)).float()
