"""DeepSeek-V4.1 for causal LM: modules with HF tensor names, and the paged forward.

The paged forward runs a batch of sequence spans against ONE PAGE pool and per-sequence state
slots, reading and writing nothing else. A span must start where its slot's cursor is (a span
at 0 resets its slot); any mismatch is refused before anything is written.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_api import Span
from atom.models.deepseek_v41.attention import CSA2Attention
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.layers import Engram, HyperConnection, MoE, RMSNorm
from atom.models.deepseek_v41.paged import PagedKV, StateMismatchError, StateSlots
from atom.models.deepseek_v41.paged_attention import SeqCarry, paged_attention
from atom.models.deepseek_v41.paged_decode import DecodeBatch
from atom.models.deepseek_v41.pool_geometry import INDEX_DTYPES, KV_DTYPES, GeometryError

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DecoderLayer(nn.Module):
    def __init__(self, config: V41Config, layer: int, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.engram = Engram(config, layer, dtype) if layer in config.engram_layer_ids else None
        self.attn_hc = HyperConnection(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = CSA2Attention(config, layer, dtype, kv_dtype)
        self.ffn_hc = HyperConnection(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = MoE(config, dtype)

    def block(self, x: torch.Tensor, grams: torch.Tensor, attend) -> torch.Tensor:
        """One layer around an attention callable ``attend(normed input) -> output``."""
        if self.engram is not None:
            x = self.engram(x, grams)
        h, post, c = self.attn_hc.pre(x)
        x = self.attn_hc.post(x, attend(self.input_layernorm(h)), post, c)
        h, post, c = self.ffn_hc.pre(x)
        return self.ffn_hc.post(x, self.mlp(self.post_attention_layernorm(h)), post, c)


class V41Model(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype, kv_dtype: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, kv_dtype) for i in range(config.num_hidden_layers)
        )
        self.head_hc = HyperConnection(config, dtype, head=True)
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
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def init_weights(self, seed: int) -> DeepseekV41ForCausalLM:
        """Random weights from a seed (presets without a checkpoint)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
                continue
            noise = torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32)
            scale = 0.5 if name.endswith(("attn_sink", "bias")) else std
            p.copy_(noise * scale)
        return self

    # ---- the paged forward ---------------------------------------------------------------

    def check_spans(self, spans: list[Span], slots: StateSlots) -> None:
        """Refuse spans whose start is not their slot's cursor (before anything is written)."""
        seen = set()
        resumed = [sp.slot for sp in spans if sp.start > 0 and 0 <= sp.slot < slots.num_slots]
        states = {}  # slot -> (cursor, tag), read in one transfer (one host sync per forward)
        if resumed:
            at = torch.stack([slots.cursor[resumed, 0], slots.header[resumed, 0]], 1).tolist()
            states = dict(zip(resumed, at))
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
            at, tag = states[sp.slot]
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
        kv: PagedKV,
        slots: StateSlots,
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
        seqs, lo, grams, positions = [], 0, [], []
        for sp in spans:
            if sp.start == 0:
                slots.reset(sp.slot)
            pos = torch.arange(sp.start, sp.end, device=dev)
            seqs.append(SeqCarry(sp, lo, pos))
            ids = token_ids[lo : lo + sp.num_tokens]
            ext = torch.cat([slots.cursor[sp.slot, 1:].to(dev), ids])
            grams.append(ext.unfold(0, 4, 1))
            positions.append(pos)
            lo += sp.num_tokens
        grams_t, pos_t = torch.cat(grams), torch.cat(positions)
        longer = [s for s in seqs if s.span.num_tokens > 1]
        single = [s for s in seqs if s.span.num_tokens == 1]
        decode = DecodeBatch.build([s.span for s in single], [s.lo for s in single], dev)
        x = self._embed(token_ids)
        for layer in self.model.layers:
            attn = layer.self_attn
            x = layer.block(
                x,
                grams_t,
                lambda u, a=attn: paged_attention(a, u, pos_t, longer, decode, kv, slots),
            )
        for seq, g in zip(seqs, grams):
            slots.cursor[seq.span.slot, 0] = seq.span.end
            slots.cursor[seq.span.slot, 1:] = g[-1, 1:]
            slots.header[seq.span.slot, 1] = seq.span.end
        if not all_logits:
            x = x[torch.tensor([s.hi - 1 for s in seqs], device=dev)]
        return self._head(x)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(token_ids)
        return e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.model.head_hc.pre(x)
        return self.lm_head(self.model.norm(h)).float()
