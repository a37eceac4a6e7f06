"""DeepSeek-V4's MTP block (``mtp.0.*``) as a draft layer: its checkpoint tensors, its forward
against a hand-built reference, the paged draft forward against the oracle, and the draft
capability the runtime publishes (``atom.model_api.DraftRuntime``)."""

import pytest
import torch
from safetensors import safe_open

from atom.model_api import DraftRuntime, Span, draft_layers
from atom.models.deepseek_v4.checkpoint import load_checkpoint
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.paged import StateMismatchError
from atom.models.deepseek_v4.presets import PRESETS, preset_config
from atom.models.deepseek_v4.reference import reference_draft_forward, reference_forward
from atom.models.deepseek_v4.runtime import V4Runtime
from atom.models.deepseek_v41.pool_geometry import GeometryError

from .test_v4_checkpoint import assert_load_refused, runtime_of, write_checkpoint
from .test_v4_paged import (  # noqa: F401  (fixtures)
    Harness,
    assert_matches,
    one_thread_fixture,
    tokens,
    v4_tiny_fixture,
)

SPEC = 2  # speculative tokens: the draft ring is window + 2 rows
NO_MTP = dict(num_nextn_predict_layers=0, compress_ratios=PRESETS["v4-tiny"]["compress_ratios"][:6])


class DraftHarness(Harness):
    """A V4 runtime with the draft state (speculative_tokens=SPEC), one pool, a few slots."""

    def __init__(self, model, speculative_tokens=SPEC, num_blocks=32, num_slots=3):
        super().__init__(
            model, num_blocks=num_blocks, num_slots=num_slots, speculative_tokens=speculative_tokens
        )
        self.table = torch.arange(num_blocks // num_slots)

    def target(self, seq, slot=0):
        """Target forward of the whole sequence: (logits [S, V], residual [S, hc, d])."""
        ids = torch.as_tensor(seq)
        table = self.table + slot * len(self.table)
        return self.rt.forward_with_residual(ids, [Span(0, len(seq), slot, table)], True)

    def draft(self, next_ids, residual, start, slot=0):
        span = Span(start, start + len(next_ids), slot, self.table)
        return self.rt.draft_forward(torch.as_tensor(next_ids), residual, [span], all_logits=True)


# ---- checkpoint ---------------------------------------------------------------------------


def test_mtp_tensors_load_exactly_from_published_formats(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt", seed=5)
    stored = {}
    for f in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            stored.update({k: sf.get_slice(k).get_dtype() for k in sf.keys()})
    assert stored["mtp.0.e_proj.weight"] == "F8_E4M3" and "mtp.0.e_proj.scale" in stored
    assert stored["mtp.0.h_proj.weight"] == "F8_E4M3" and "mtp.0.h_proj.scale" in stored
    assert stored["mtp.0.ffn.experts.3.w2.weight"] == "I8"
    assert "mtp.0.ffn.experts.3.w2.scale" in stored
    assert stored["mtp.0.attn.wq_a.weight"] == "F8_E4M3"
    assert stored["mtp.0.hc_head_fn"] == "F32" and stored["mtp.0.enorm.weight"] == "BF16"
    assert not any(k.startswith("mtp.0.attn.compressor") for k in stored)  # window-only
    assert "mtp.0.ffn.gate.bias" in stored and "mtp.0.ffn.gate.tid2eid" not in stored

    rt = runtime_of(tmp_path / "ckpt")
    got = rt.model.state_dict()
    mtp = [k for k in exact if k.startswith("mtp.0.")]
    assert len(mtp) > 30 and {k for k in got if k.startswith("mtp.")} == set(mtp)
    for name in mtp:
        assert torch.equal(got[name], exact[name].to(got[name].dtype)), name
    assert got["mtp.0.ffn.experts.3.down_proj.weight"].unique().numel() > 8
    assert rt.num_draft_layers == 1


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(drop=["mtp.0.h_proj.weight"]), "missing tensor mtp.0.h_proj.weight"),
        (dict(drop=["mtp.0.e_proj.scale"]), "mtp.0.e_proj.scale is missing"),
        (
            dict(extra={"mtp.0.attn.compressor.ape": torch.zeros(4, 64)}),
            "unexpected tensor mtp.0.attn.compressor.ape",
        ),
        (
            dict(extra={"mtp.0.ffn.experts.1.w1.weight": torch.zeros(32, 64, dtype=torch.int8)}),
            "tensor mtp.0.ffn.experts.1.w1.weight has packed shape [32, 64]",
        ),
        (dict(extra={"mtp.0.hnorm.weight": torch.zeros(63)}), "mtp.0.hnorm.weight has shape [63]"),
    ],
)
def test_bad_mtp_tensors_are_refused_naming_the_tensor(tmp_path, change, needle):
    assert_load_refused(tmp_path / "ckpt", change, needle)


def test_a_model_without_mtp_leaves_the_mtp_tensors_unread(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt", seed=2)
    model = DeepseekV4ForCausalLM(preset_config("v4-tiny", **NO_MTP))
    load_checkpoint(model, tmp_path / "ckpt")
    assert model.num_draft_layers == 0
    assert torch.equal(model.state_dict()["head.weight"], exact["head.weight"])


# ---- the forward --------------------------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 if w is None else w)


def _rope(x, pos, dim, theta, inverse=False):
    """Interleaved RoPE on the last ``dim`` features, plain theta (no YaRN), by hand."""
    ang = pos[:, None].float() / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = (-ang if inverse else ang).view(x.shape[0], *([1] * (x.dim() - 2)), dim // 2)
    x1, x2 = x[..., -dim:][..., 0::2], x[..., -dim:][..., 1::2]
    rot = torch.stack([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)
    return torch.cat([x[..., :-dim], rot.flatten(-2)], -1)


def hand_built_mtp(model, next_ids, residual):
    """The MTP block spelled out: its input, a window-only attention (sliding window, sink,
    interleaved RoPE at rope_theta, grouped output), its head; mHC and the MoE are the block's
    modules (tested against the oracle elsewhere)."""
    c, m = model.config, model.mtp[0]
    eps, n = c.rms_norm_eps, len(next_ids)
    pos = torch.arange(n)
    e = _rms(model.embed.weight[next_ids], m.enorm.weight, eps) @ m.e_proj.weight.T
    x = e[:, None, :] + _rms(residual, m.hnorm.weight, eps) @ m.h_proj.weight.T

    h, post, comb = m.hc_attn.pre(x)
    u = _rms(h, m.attn_norm.weight, eps)
    a, hd, nh, rd = m.attn, c.head_dim, c.num_attention_heads, c.qk_rope_head_dim
    qr = _rms(u @ a.wq_a.weight.T, a.q_norm.weight, eps)
    q = _rope(_rms((qr @ a.wq_b.weight.T).view(n, nh, hd), None, eps), pos, rd, c.rope_theta)
    kv = _rope(_rms(u @ a.wkv.weight.T, a.kv_norm.weight, eps), pos, rd, c.rope_theta)
    o = torch.zeros(n, nh, hd)
    for t in range(n):
        keys = kv[max(0, t - c.sliding_window + 1) : t + 1]
        logits = torch.cat([q[t] @ keys.T * hd**-0.5, a.attn_sink[:, None]], 1)
        o[t] = torch.softmax(logits, -1)[:, :-1] @ keys
    o = _rope(o, pos, rd, c.rope_theta, inverse=True).reshape(n, c.o_groups, -1)
    wo_a = a.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1)
    mid = torch.stack([o[:, g] @ wo_a[g].T for g in range(c.o_groups)], 1).flatten(1)
    x = m.hc_attn.post(x, mid @ a.wo_b.weight.T, post, comb)

    h, post, comb = m.hc_ffn.pre(x)
    x = m.hc_ffn.post(x, m.ffn(_rms(h, m.ffn_norm.weight, eps), next_ids), post, comb)

    flat = _rms(x.flatten(1), None, eps)
    pre = torch.sigmoid(flat @ m.hc_head.fn.T * m.hc_head.scale[0] + m.hc_head.base) + c.hc_eps
    hh = (pre[:, :, None] * x).sum(1)
    return _rms(hh, m.norm.weight, eps) @ model.head.weight.T, x


def test_mtp_forward_on_a_known_residual_equals_the_hand_built_one(v4_tiny):
    c = v4_tiny.config
    assert v4_tiny.mtp[0].attn.ratio == 0 and v4_tiny.mtp[0].layer == c.num_hidden_layers
    n = 21  # past the window (8): the sliding window matters
    next_ids = torch.tensor(tokens(n, seed=4))
    residual = torch.randn(n, c.hc_mult, c.hidden_size, generator=torch.Generator().manual_seed(1))
    logits, x = reference_draft_forward(v4_tiny, next_ids, residual)
    want_logits, want_x = hand_built_mtp(v4_tiny, next_ids, residual)
    assert (x - want_x).abs().max() < 1e-4
    assert_matches(logits, want_logits)


def test_paged_residual_and_draft_chunks_equal_the_oracle(v4_tiny):
    """Target residual from the paged forward = the oracle's; the draft over chunks (window
    wraps, token by token at the end) = the oracle's draft."""
    seq = tokens(41, seed=6)
    ref_logits, ref_res = reference_forward(v4_tiny, seq, return_residual=True)
    h = DraftHarness(v4_tiny)
    logits, res = h.target(seq)
    assert_matches(logits, ref_logits)
    assert (res - ref_res).abs().max() < 1e-4
    next_ids, res = seq[1:], res[:-1]  # draft at p reads token p + 1 and the residual at p
    want_logits, want_x = reference_draft_forward(v4_tiny, next_ids, res)
    outs, xs, start = [], [], 0
    for end in [5, 12, 13, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]:
        lg, x = h.draft(next_ids[start:end], res[start:end], start)
        outs.append(lg)
        xs.append(x)
        start = end
    assert_matches(torch.cat(outs), want_logits)
    assert (torch.cat(xs) - want_x).abs().max() < 1e-4


def test_chained_drafts_then_a_rerun_after_verification(v4_tiny):
    """Chain SPEC drafts past the target (each feeding its own residual), then re-run the
    draft from the first chained position with the target's residuals: the result is the
    oracle's, as if the chained (rejected) positions had never run."""
    seq = tokens(30, seed=9)
    h = DraftHarness(v4_tiny)
    _, res = h.target(seq[:20])
    h.draft(seq[1:20], res[:19], 0)  # positions 0..18
    lg, x = h.draft(seq[20:21], res[19:20], 19)  # the sampled token 20: predicts 21
    for p in range(20, 20 + SPEC):  # chained: its own residual, its own guess
        lg, x = h.draft(lg.argmax(-1), x, p)
    # verification accepted the target's tokens 20..29: rerun from 20 with true inputs
    _, res_all = h.target(seq, slot=1)  # (a second slot: the target of the whole sequence)
    lg, x = h.draft(seq[21:30], res_all[20:29], 20)
    want, _ = reference_draft_forward(v4_tiny, seq[1:30], res_all[:29])
    assert_matches(lg, want[20:29])


def test_draft_spans_the_state_cannot_continue_are_refused(v4_tiny):
    seq = tokens(30, seed=3)
    h = DraftHarness(v4_tiny)
    _, res = h.target(seq)
    h.draft(seq[1:11], res[:10], 0)
    before = h.slot_bytes.clone()
    with pytest.raises(StateMismatchError, match="draft layer 0 is at 10"):
        h.draft(seq[12:14], res[11:13], 11)  # skips position 10
    with pytest.raises(StateMismatchError, match=r"needs it in \[7, 9\]"):
        h.draft(seq[8:10], res[7:9], 7)  # rewinds past what the ring keeps (SPEC)
    assert torch.equal(h.slot_bytes, before)
    h.draft(seq[9:12], res[8:11], 8)  # a rewind of SPEC positions is fine
    with pytest.raises(ValueError, match="residual must be"):
        h.draft(seq[12:14], res[11:12], 11)


def test_draft_writes_only_its_own_ring_and_cursor(v4_tiny):
    seq = tokens(25, seed=2)
    h = DraftHarness(v4_tiny)
    _, res = h.target(seq)
    pool, slots = h.pool.clone(), h.slot_bytes.clone()
    h.draft(seq[1:25], res[:24], 0)
    assert torch.equal(h.pool, pool)
    geo, sl = h.rt.geometry, h.rt.slots
    changed = (h.slot_bytes != slots).any(0).nonzero().flatten()
    ring = geo.field("window")
    row = geo.window_rows * geo.head_dim * 4  # fp32 rows, one layer's ring
    mtp_ring = range(
        ring.offset + geo.state_layers * row - row, ring.offset + geo.state_layers * row
    )
    cur = geo.field("draft_cursor")
    allowed = set(mtp_ring) | set(range(cur.offset, cur.offset + cur.nbytes))
    assert changed.numel() and set(changed.tolist()) <= allowed
    assert int(sl.draft_cursor[0, 0]) == 24 and int(sl.cursor[0, 0]) == 25


def test_the_runtime_publishes_the_draft_capability(v4_tiny):
    rt = V4Runtime(v4_tiny, block_size=16, speculative_tokens=SPEC)
    assert isinstance(rt, DraftRuntime) and draft_layers(rt) == 1
    assert draft_layers(object()) == 0
    plain = DraftHarness(v4_tiny, speculative_tokens=0)  # no draft state in the geometry
    _, res = plain.target(tokens(5, seed=1))
    with pytest.raises(GeometryError, match="speculative_tokens >= 1"):
        plain.draft([1, 2, 3, 4], res[:4], 0)


def test_main_weights_do_not_depend_on_the_mtp_block():
    with_mtp = DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(7)
    without = DeepseekV4ForCausalLM(preset_config("v4-tiny", **NO_MTP)).init_weights(7)
    main = without.state_dict()
    got = with_mtp.state_dict()
    assert all(torch.equal(got[k], v) for k, v in main.items())
