"""V4.1's per-token math pinned to DeepSeek's published inference code, component by component,
on hand-worked cases (the numbers in the comments were worked out from the formulas, not read
off the code under test). Items as the published-V4.1 issue lists them: mHC wiring (1), the
mixing values (2), Sinkhorn (3), RoPE pairs (4), the softmax scale (5), the roundings (6, 11,
as switches), the router (9) and the experts' routing weight applied before their down
projection; the Engram (8) in test_engram_published.py."""

from __future__ import annotations

import math

import pytest
import torch

from atom.kernels.sinkhorn import sinkhorn_torch
from atom.model_api import Span
from atom.models.common.config import ConfigError
from atom.models.common.formats import fp8_act_sim
from atom.models.common.mhc import HcMixer, collapse, identity_pre
from atom.models.common.moe import MoE
from atom.models.common.rope import InterleavedRope
from atom.models.deepseek_v41.model import DecoderLayer, DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.runtime import V41Runtime


def test_sinkhorn_is_softmax_then_a_column_step_then_row_column_rounds():
    # logits [[0, ln 3], [0, 0]]: row softmax [[1/4, 3/4], [1/2, 1/2]]; column sums 3/4, 5/4
    # -> [[1/3, 3/5], [2/3, 2/5]] (iters = 1 stops here: it ends on columns).
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]])
    c1 = sinkhorn_torch(logits, 2, 1, 0.0)[0]
    torch.testing.assert_close(c1, torch.tensor([[1 / 3, 3 / 5], [2 / 3, 2 / 5]]))
    # iters = 2: rows (sums 14/15, 16/15) -> [[5/14, 9/14], [5/8, 3/8]]; columns (sums 55/56,
    # 57/56) -> [[4/11, 12/19], [7/11, 7/19]]
    c2 = sinkhorn_torch(logits, 2, 2, 0.0)[0]
    torch.testing.assert_close(c2, torch.tensor([[4 / 11, 12 / 19], [7 / 11, 7 / 19]]))
    # eps sits in every denominator: with eps, the first column step divides by (3/4 + eps)
    eps = 0.25
    ce = sinkhorn_torch(logits, 2, 1, eps)[0]
    # softmax + eps: [[1/2, 1], [3/4, 3/4]]; column sums + eps: 3/2, 2 -> [[1/3, 1/2], [1/2, 3/8]]
    torch.testing.assert_close(ce, torch.tensor([[1 / 3, 1 / 2], [1 / 2, 3 / 8]]))


def test_mixer_scales_each_group_and_adds_its_base():
    # hc = 1, d = 2: x = [3, 4], rms = sqrt(12.5) -> normalized [0.848528, 1.131371];
    # fn rows [1, 0], [0, 1], [1, 1] -> mix [0.848528, 1.131371, 1.979899]
    m = HcMixer(hc=1, dim=2, iters=20, eps=1e-6, norm_eps=1e-20)
    with torch.no_grad():
        m.fn.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        m.scale.copy_(torch.tensor([2.0, 1.0, 0.5]))
        m.base.copy_(torch.tensor([0.1, -0.2, 0.3]))
    pre, post, comb = m.mixes(torch.tensor([[[3.0, 4.0]]]))
    # pre = sigmoid(2 * 0.848528 + 0.1) + 1e-6; post = 2 sigmoid(1.131371 - 0.2)
    torch.testing.assert_close(pre, torch.tensor([[0.8577912]]))
    torch.testing.assert_close(post, torch.tensor([[1.4347066]]))
    # a 1 x 1 matrix: (1 + eps) / (1 + 2 eps) ~ 1
    torch.testing.assert_close(comb, torch.ones(1, 1, 1), atol=3e-6, rtol=0)


def test_interleaved_rope_rotates_adjacent_pairs():
    # dim 4, theta 10000: frequencies [1, 0.01]; at position 1 the pair (x0, x1) turns by 1
    # rad, (x2, x3) by 0.01 rad: [1, 0, 0, 1] -> [cos 1, sin 1, -sin 0.01, cos 0.01]
    rope = InterleavedRope(4, 10000.0, None)
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    got = rope.apply(x, rope.cos_sin(torch.tensor([1])))
    want = torch.tensor([[0.5403023, 0.8414710, -0.0099998, 0.9999500]])
    torch.testing.assert_close(got, want)
    assert torch.equal(x, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))  # apply copies, apply_ writes
    back = rope.apply_(got.clone(), rope.cos_sin(torch.tensor([1])), inverse=True)
    torch.testing.assert_close(back, x)


def test_softmax_scale_is_head_dim_only_on_every_layer():
    cfg = preset_config("v41-tiny")
    model = DeepseekV41ForCausalLM(cfg)
    for layer in model.model.layers:
        assert layer.self_attn.scale == cfg.head_dim**-0.5  # YaRN layers too: no mscale


def test_router_normalises_with_1e20_and_divides_logits_by_the_temperature():
    cfg = preset_config("v41-tiny", n_routed_experts=3, num_experts_per_tok=2)
    for temp in (1.0, 2.0):
        moe = MoE(cfg, torch.float32, gate_temp=temp)
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[2, 0] = math.log(math.e - 1.0)
        x = torch.zeros(1, cfg.hidden_size)
        x[0, 0] = 1.0
        idx, w = moe.route(x)
        # logits [0, 0, ln(e - 1)] / temp; scores sqrt(softplus): softplus(0) = ln 2 ->
        # 0.832555; temp 1: softplus(ln(e - 1)) = 1 -> 1; temp 2: sqrt(ln(1 + sqrt(e - 1)))
        # = 0.915209. Top 2: expert 2 and expert 0 (a tie with 1: the smaller id)
        s2 = 1.0 if temp == 1.0 else 0.9152092
        assert idx.tolist() == [[2, 0]]
        want = torch.tensor([[s2, 0.8325546]]) / (s2 + 0.8325546) * cfg.routed_scaling_factor
        torch.testing.assert_close(w, want)


def test_routing_weight_scales_the_down_projections_input_before_its_e4m3_rounding():
    """Both published references weight an expert's SwiGLU output before its down projection
    (whose FP8 linear rounds its input to E4M3 per 32). Hand-worked: h = [3, 1.1, 0, ...]
    (gate 100, where silu is the identity in float32; up 0.03 and 0.011), weight 0.75:
    w * h = [2.25, 0.825]; block scale 2^ceil(log2(2.25 / 448)) = 2^-7; 0.825 * 128 = 105.6
    rounds to 104 (E4M3 steps of 8 in [64, 128)), so 0.8125. Weighting the output instead
    gives 0.75 * round(1.1) = 0.75 * 1.125 (140.8 -> 144 in steps of 16) = 0.84375."""
    from atom.models.common.moe import Expert

    e = Expert(32, 32, 1000.0, torch.float32)
    e.act = fp8_act_sim
    with torch.no_grad():
        for p in e.parameters():
            p.zero_()
        e.gate_proj.weight[:, 0] = 100.0
        e.up_proj.weight[0, 0], e.up_proj.weight[1, 0] = 0.03, 0.011
        e.down_proj.weight.copy_(torch.eye(32))
        x = torch.zeros(1, 32)
        x[0, 0] = 1.0
        got = e(x, torch.tensor([[0.75]]))
        unweighted = e(x)
    assert got[0, :2].tolist() == [2.25, 0.8125] and not got[0, 2:].any()
    assert unweighted[0, :2].tolist() == [3.0, 1.125]


def test_every_dispatch_path_weights_before_the_down_projection():
    """The per-expert loop and the dense path compute the same function: each token's shared
    expert plus sum over its experts of expert(x, w) (weight inside), with the E4M3 input
    rounding on, where weighting the output instead would differ."""
    cfg = preset_config("v41-tiny", n_routed_experts=4, num_experts_per_tok=2)
    moe = MoE(cfg, torch.float32, act_fp8=True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        x = torch.randn(5, cfg.hidden_size, generator=gen)
        idx, w = moe.route(x)
        want = moe.shared_experts(x).clone()
        after = want.clone()
        for t in range(5):
            for s in range(2):
                expert = moe.experts[int(idx[t, s])]
                want[t] += expert(x[t : t + 1], w[t : t + 1, s : s + 1])[0]
                after[t] += w[t, s] * expert(x[t : t + 1])[0]
        assert moe.path(5, x) == "dense"
        dense = moe.mix(x, idx, w)
        moe.DENSE_MAX_TOKENS = 0
        assert moe.path(5, x) == "loop"
        loop = moe.mix(x, idx, w)
    torch.testing.assert_close(dense, want, atol=2e-6, rtol=0)
    torch.testing.assert_close(loop, want, atol=2e-6, rtol=0)
    assert (after - want).abs().max() > 1e-3  # the order is observable


class _Recorder:
    def __init__(self):
        self.seen = []

    def __call__(self, u):
        self.seen.append(u.clone())
        return torch.zeros_like(u)


def test_each_sublayer_collapses_with_its_predecessors_mix():
    """The attention reads the streams collapsed with the ``pre`` it is given; the FFN reads
    them collapsed with the ``pre`` the attention's mixer computed *before* attention; the layer
    returns its FFN mixer's ``pre``, computed from the streams between the two sublayers."""
    cfg = preset_config("v41-tiny")
    layer = DecoderLayer(cfg, 0, torch.float32, "fp32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.fill_(1.0)
    x = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    given = torch.zeros(3, cfg.hc_mult)
    given[:, 2] = 1.0  # read stream 2 only
    seen_ffn = []
    layer.mlp.forward = lambda u: seen_ffn.append(u.clone()) or torch.zeros_like(u)
    attend = _Recorder()
    out, ffn_pre = layer.block(x, given, None, attend)
    torch.testing.assert_close(attend.seen[0], layer.input_layernorm(x[:, 2]))
    attn_pre, post, comb = layer.attn_hc.mixes(x)
    # a zero attention output leaves X_j = sum_i C_ij X_i
    mid = torch.einsum("nij,nid->njd", comb, x)
    torch.testing.assert_close(seen_ffn[0], layer.post_attention_layernorm(collapse(mid, attn_pre)))
    torch.testing.assert_close(ffn_pre, layer.ffn_hc.mixes(mid)[0])
    assert not torch.allclose(ffn_pre, layer.ffn_hc.mixes(out)[0])  # not the output's mix


def test_the_head_reads_the_last_ffn_mix_and_the_first_layer_stream_zero():
    cfg = preset_config("v41-tiny")
    model = DeepseekV41ForCausalLM(cfg).init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    x = model._embed(ids)
    assert torch.equal(identity_pre(x)[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # no separate head mixer in the parameters, as published (no hc_head_* tensors)
    assert not [n for n in dict(model.named_parameters()) if n.startswith("model.head")]
    logits = reference_forward(model, ids.tolist())
    assert logits.shape == (12, cfg.vocab_size) and torch.isfinite(logits).all()


def test_golden_logits_of_a_fixed_small_model():
    """Golden values recorded from this implementation (v41-tiny, fp32, seed 0, 8 tokens), so
    any change to the forward's function shows here. Re-derive with
    ``reference_forward(DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0),
    list(range(1, 9)))[:, :4]`` and explain the change in the commit."""
    model = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    got = reference_forward(model, list(range(1, 9)))
    torch.testing.assert_close(got[:, :4], GOLDEN, atol=1e-4, rtol=0)


# reference_forward of v41-tiny (fp32, init_weights(0)) on tokens 1..8, logits of tokens 0..3,
# recorded once the forward followed the published structure (items 1-5, 9) and Engram (8);
# v41-tiny keeps the roundings (6, 11) off, so they do not move these
GOLDEN = torch.tensor(
    [
        [-0.28252, 0.01022, -0.26289, -0.80283],
        [0.19236, 0.66504, 0.40034, -0.69252],
        [-0.59713, 0.20947, -0.06214, 0.55018],
        [-0.37833, -0.03385, -0.93353, -1.03626],
        [0.09683, -0.22463, -1.41740, -0.71500],
        [-0.35579, 0.02484, -0.90530, -1.00843],
        [-0.21491, -0.03801, -1.31380, -1.10873],
        [-1.04163, -0.14095, -1.40667, -0.49780],
    ]
)


SIMS = dict(kv_fp8_sim=True, compressed_fp4_sim=True, index_fp4_sim=True, act_fp8_sim=True)


def test_rounding_switches_need_whole_blocks():
    with pytest.raises(ConfigError, match="q_lora_rank=48 is invalid: must be a multiple of 32"):
        preset_config("v41-tiny", q_lora_rank=48, act_fp8_sim=True)
    preset_config("v41-tiny", q_lora_rank=48)  # fine with the switch off


def test_window_rows_are_e4m3_per_32_and_each_switch_moves_the_logits():
    """With ``kv_fp8_sim`` a window row is a fixed point of the E4M3 rounding (it was rounded
    once, over its whole rotated vector); each switch changes the forward's function."""
    cfg = preset_config("v41-tiny", **SIMS)
    model = DeepseekV41ForCausalLM(cfg).init_weights(0)
    attn = model.model.layers[3].self_attn
    u = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = attn.window_kv(u, attn.rope.cos_sin(torch.arange(5)))
    assert torch.equal(fp8_act_sim(rows, 32), rows)
    assert not torch.equal(fp8_act_sim(u, 32), u)  # the rounding is not the identity here
    ids = list(range(3, 40))
    plain = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(0)
    base = reference_forward(plain, ids)
    for name in SIMS:
        one = DeepseekV41ForCausalLM(preset_config("v41-tiny", **{name: True})).init_weights(0)
        assert not torch.allclose(reference_forward(one, ids), base, atol=1e-4), name


def test_paged_forward_with_every_rounding_keeps_the_references_greedy_tokens():
    """Chunked paged forward against the reference with all four roundings on: a last-bit
    difference may cross a rounding boundary (so no float tolerance), but greedy tokens hold."""
    cfg = preset_config("v41-tiny", **SIMS)
    model = DeepseekV41ForCausalLM(cfg).init_weights(0)
    rt = V41Runtime(model, block_size=16)
    pool = torch.zeros(rt.spec.pool_shape(8), dtype=rt.spec.pool_dtype)
    slots = torch.zeros(2, rt.spec.state_bytes, dtype=torch.uint8)
    rt.bind(pool, slots)
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(3))
    outs, start = [], 0
    for end in (16, 29, 48, 70):
        span = Span(start, end, 1, torch.arange(5))
        outs.append(model.forward_paged(ids[start:end], [span], rt.kv, rt.slots, True))
        start = end
    paged, ref = torch.cat(outs), reference_forward(model, ids.tolist())
    assert (paged.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
