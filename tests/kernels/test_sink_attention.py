"""The sink attention kernel against its torch expression (on CUDA, or on CPU under Triton's
interpreter; CI has neither), and the torch expression against the layer's own attention
(everywhere): what the kernel computes is what ``CSA2Attention.attend_tiles`` computes."""

import pytest
import torch

import atom.kernels
from atom.kernels.attention import (
    RingWindow,
    gather_offsets,
    sink_attention,
    sink_attention_decode,
    sink_attention_torch,
    sink_attention_usable,
)
from atom.kernels.index_scores import index_scores_usable
from atom.models.deepseek_v41.attention import CSA2Attention
from atom.models.deepseek_v41.presets import preset_config
from tests.kernels.runnable import DEVICE, cpu_harness_only, needs_kernel


def _case(device, dtype, tiles, per_tile, heads, d, window, k, gen):
    """Queries, window keys with masks (one row sees nothing), a PAGE-like plane whose rows
    are strided blocks, offsets of random rows with validity (one row has none valid)."""
    t = tiles * per_tile
    q = torch.randn(t, heads, d, generator=gen).to(device, dtype)
    win_k = torch.randn(tiles, window, d, generator=gen).to(device, dtype)
    mask = torch.rand(t, window, generator=gen) < 0.7
    mask[0] = False
    blocks, rows = 6, 8
    plane = None
    if k:  # 24 elements between blocks: rows are contiguous, blocks are not
        raw = torch.randn(blocks, rows * d + 24, generator=gen).to(device, dtype)
        plane = raw[:, : rows * d].view(blocks, rows, d)
        b = torch.randint(0, blocks, (t, k), generator=gen)
        r = torch.randint(0, rows, (t, k), generator=gen)
        offsets = (b * plane.stride(0) + r * plane.stride(1)).to(device)
        valid = torch.rand(t, k, generator=gen) < 0.8
        valid[-1] = False
        valid = valid.to(device)
    else:
        offsets = valid = None
    sink = torch.randn(heads, generator=gen).to(device)
    return q, win_k, mask.to(device), plane, offsets, valid, sink


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tiles,per_tile,heads,window,k",
    # the last: 256 rows of 64 heads, where bfloat16 runs all heads in one program
    [
        (5, 1, 20, 10, 37),
        (3, 4, 16, 7, 0),
        (2, 8, 64, 70, 64),
        (1, 1, 3, 1, 1),
        (4, 64, 64, 90, 40),
    ],
)
def test_kernel_matches_the_torch_expression(dtype, tiles, per_tile, heads, window, k):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (a 16x16 dot alone)")
    gen = torch.Generator().manual_seed(tiles * 100 + k)
    q, win_k, mask, plane, offsets, valid, sink = _case(
        DEVICE, dtype, tiles, per_tile, heads, 64, window, k, gen
    )
    assert sink_attention_usable(q)
    got = sink_attention(q, win_k, mask, plane, offsets, valid, sink, 0.125)
    comp = gather_offsets(offsets, plane) if plane is not None else None
    want = sink_attention_torch(q, win_k, mask, comp, valid, sink, 0.125)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (
        (got.float() - want.float()).abs().max()
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,heads,window,k", [(1, 16, 128, 512), (16, 64, 9, 37), (5, 20, 33, 0)]
)
def test_decode_splits_match_the_torch_expression(dtype, rows, heads, window, k):
    """A decode batch's rows, each with its own window keys, with keys split across programs
    and combined (``sink_attention_decode``): what the torch expression computes, a row with
    no visible key and a row with no valid compressed row included."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (a 16x16 dot alone)")
    gen = torch.Generator().manual_seed(rows * 7 + k)
    q, win_k, mask, plane, offsets, valid, sink = _case(
        DEVICE, dtype, rows, 1, heads, 64, window, k, gen
    )
    got = sink_attention_decode(q, win_k, mask, plane, offsets, valid, sink, 0.125)
    comp = gather_offsets(offsets, plane) if plane is not None else None
    want = sink_attention_torch(q, win_k, mask, comp, valid, sink, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (
        (got.float() - want.float()).abs().max()
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,window,k", [(4, 9, 37), (16, 128, 0), (3, 1, 5)])
def test_decode_reads_a_ring_window_in_place_with_the_same_bits(dtype, rows, window, k):
    """``sink_attention_decode`` given a ``RingWindow`` (ring rows at offsets, then each row's
    own key) returns the bits it returns for the same keys materialized [T, L, D]: the decode
    step drops its per-layer gather and concatenation with no change to any output."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (a 16x16 dot alone)")
    gen = torch.Generator().manual_seed(rows * 13 + window)
    q, _, mask, plane, offsets, valid, sink = _case(DEVICE, dtype, rows, 1, 16, 64, window, k, gen)
    slots, ring_rows = 5, window + 3  # a ring plane of several slots, strided like the state's
    raw = torch.randn(slots, 2 * ring_rows * 64 + 8, generator=gen).to(DEVICE, dtype)
    ring = raw[:, ring_rows * 64 : 2 * ring_rows * 64].view(slots, ring_rows, 64)
    slot = torch.randint(0, slots, (rows, 1), generator=gen)
    row = torch.randint(0, ring_rows, (rows, window - 1), generator=gen)
    at = (slot * ring.stride(0) + row * ring.stride(1)).to(DEVICE)
    own = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    mask[:, -1] = True  # a row's own key is always visible
    window_keys = RingWindow(ring, at, own)
    keys = window_keys.keys()
    assert torch.equal(keys[:, -1], own)
    assert window == 1 or torch.equal(keys[1, 0], ring[slot[1, 0], row[1, 0]])
    got = sink_attention_decode(q, window_keys, mask, plane, offsets, valid, sink, 0.125)
    want = sink_attention_decode(q, keys, mask, plane, offsets, valid, sink, 0.125)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@needs_kernel
# float32's default is 16 heads and 16 keys a tile, one stage
@pytest.mark.parametrize("config", [{"BN": 32}, {"BH": 32, "BN": 64, "num_stages": 3}])
def test_launch_parameters_compute_the_same(config):
    """Other tilings (launch parameters the sweep benchmark tries) compute what the default
    one computes, masked rows and a row without a visible key included."""
    from atom.kernels._attention_triton import sink_attention_triton

    gen = torch.Generator().manual_seed(3)
    args = _case(DEVICE, torch.float32, 3, 4, 40, 64, 19, 21, gen)
    base = sink_attention_triton(*args, 0.125)
    other = sink_attention_triton(*args, 0.125, config=config)
    assert torch.allclose(other, base, atol=1e-6, rtol=1e-6), (other - base).abs().max()


@needs_kernel
def test_in_the_mode_a_decode_sized_call_gives_a_rows_prefill_bits(monkeypatch):
    """Batch-invariant mode: a call of few rows (a decode batch) spreads each row's output
    features over programs (DV < D); the same rows inside a call of many rows (a prefill's
    per-query windows) run one program per row and block of heads. Every row's output has
    the same bits either way, and what the torch expression computes."""
    from atom.kernels import _attention_triton as k
    from atom.kernels import invariant

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    d = 512 if DEVICE == "cuda" else 64
    monkeypatch.setattr(k, "INVARIANT_DV", d // 4)
    invariant.configure(True)
    try:
        gen = torch.Generator().manual_seed(5)
        scale = d**-0.5  # 1 / sqrt(d); 0.125 over 512 random features gives near one-hot rows
        rows = k.INVARIANT_FEW_ROWS + 4
        q, win_k, mask, plane, offsets, valid, sink = _case(
            DEVICE, dtype, rows, 1, 64, d, 40, 30, gen
        )
        assert k.sink_attention_config(3, 64, False, d)["DV"] == d // 4
        assert k.sink_attention_config(rows, 64, False, d)["DV"] == d
        many = sink_attention(q, win_k, mask, plane, offsets, valid, sink, scale)
        for lo, hi in [(0, 3), (7, 23), (rows - 16, rows)]:
            few = sink_attention(
                q[lo:hi], win_k[lo:hi], mask[lo:hi], plane, offsets[lo:hi], valid[lo:hi],
                sink, scale,
            )  # fmt: skip
            assert torch.equal(few, many[lo:hi]), (lo, hi)
        comp = gather_offsets(offsets, plane)
        want = sink_attention_torch(q, win_k, mask, comp, valid, sink, scale)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        err = (many.float() - want.float()).abs().max().item()
        assert torch.allclose(many.float(), want.float(), atol=tol, rtol=tol), err
    finally:
        invariant.configure(False)


@needs_kernel
def test_masked_keys_never_reach_the_output():
    """NaN bytes in masked window rows and in invalid compressed rows (a block nobody wrote)
    change nothing: the kernel does not load them."""
    gen = torch.Generator().manual_seed(7)
    q, win_k, mask, plane, offsets, valid, sink = _case(
        DEVICE, torch.float32, 4, 1, 16, 64, 9, 12, gen
    )
    last = plane.shape[0] - 1  # invalid picks point into the last block, valid ones never
    valid &= offsets // plane.stride(0) != last
    offsets = torch.where(valid, offsets, offsets % plane.stride(0) + last * plane.stride(0))
    clean = sink_attention(q, win_k, mask, plane, offsets, valid, sink, 0.1)
    win_k[0, ~mask[0]] = float("nan")
    plane[last] = float("nan")
    dirty = sink_attention(q, win_k, mask, plane, offsets, valid, sink, 0.1)
    assert not torch.isnan(dirty).any()
    assert torch.equal(clean, dirty)


def test_atom_triton_off_names_kernels(kernels_on, monkeypatch):
    q, qi = torch.zeros(1, 1, 64), torch.zeros(1, 2, 32)
    assert sink_attention_usable(q) and index_scores_usable(qi)
    monkeypatch.setenv("ATOM_TRITON_OFF", "index_scores, sink_attention")
    assert not sink_attention_usable(q) and not index_scores_usable(qi)
    monkeypatch.setenv("ATOM_TRITON_OFF", "index_scores")
    assert sink_attention_usable(q) and not index_scores_usable(qi)
    assert sink_attention_usable(q, "decode_attention")  # on by default
    monkeypatch.setattr(atom.kernels, "OPT_IN", frozenset({"decode_attention"}))
    assert not sink_attention_usable(q, "decode_attention")  # an opt-in kernel: off until named
    monkeypatch.setenv("ATOM_TRITON_ON", "decode_attention")
    monkeypatch.setenv("ATOM_TRITON_OFF", "")
    assert sink_attention_usable(q, "decode_attention")
    monkeypatch.setenv("ATOM_TRITON_OFF", "decode_attention")  # off wins
    assert sink_attention_usable(q) and not sink_attention_usable(q, "decode_attention")
    monkeypatch.setenv("ATOM_TRITON", "0")
    assert not sink_attention_usable(q)


def test_gradients_take_the_torch_expressions(kernels_on):
    """The kernels have no backward: under autograd, tensors that want gradients never reach
    them (training runs attention and index scores through torch)."""
    q = torch.zeros(1, 1, 64, requires_grad=True)
    qi = torch.zeros(1, 2, 32, requires_grad=True)
    assert not sink_attention_usable(q) and not index_scores_usable(qi)
    with torch.no_grad():
        assert sink_attention_usable(q) and index_scores_usable(qi)


@pytest.mark.parametrize("per_tile", [1, 4])
def test_torch_expression_is_the_layers_attention(per_tile):
    """In float32 the expression equals ``CSA2Attention.attend_tiles`` (what the model runs
    without the kernel), sink and scale included, on CPU."""
    torch.manual_seed(0)
    cfg = preset_config("v41-tiny")
    attn = CSA2Attention(cfg, 4, torch.float32, "fp32")
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(cfg.num_attention_heads))
    gen = torch.Generator().manual_seed(per_tile)
    q, win_k, mask, plane, offsets, valid, _ = _case(
        "cpu", torch.float32, 3, per_tile, cfg.num_attention_heads, cfg.head_dim, 11, 5, gen
    )
    comp = gather_offsets(offsets, plane)
    want = attn.attend_tiles(
        q.view(3, per_tile, *q.shape[1:]), win_k, mask.view(3, per_tile, -1), comp, valid
    )
    got = sink_attention_torch(q, win_k, mask, comp, valid, attn.attn_sink.detach(), attn.scale)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@needs_kernel
@cpu_harness_only
def test_decode_steps_through_the_ring_window_compute_the_gathered_windows_bits(monkeypatch):
    """v41-tiny decoding four sequences with the decode kernel: reading each layer's window
    ring in place (``RingWindow``) gives the logits and pool bytes of the same steps with the
    window gathered into [T, L, D] first, and every layer took the in-place read. (The
    harness runs on CPU, so under Triton's interpreter only; on CUDA the decode kernel's steps
    meet the reference in tests/gpu/test_cuda_paths.py.)"""
    from atom.kernels import KERNELS
    from atom.models.deepseek_v41 import paged_decode
    from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tests.model.harness import prefill_then_decode
    from tests.model.test_paged_vs_reference import tokens

    # the other kernels off: this compares the window's read alone (quicker interpreted)
    monkeypatch.setenv("ATOM_TRITON_OFF", ",".join(sorted(KERNELS - {"decode_attention"})))
    model = DeepseekV41ForCausalLM(preset_config("v41-tiny"), kv_dtype="fp32").init_weights(0)
    rings = []
    seqs = [tokens(20, seed=60 + i) for i in range(4)]
    runs = []
    for in_place in (True, False):
        if in_place:
            monkeypatch.setattr(
                paged_decode, "RingWindow", lambda *a: rings.append(1) or RingWindow(*a)
            )
        else:
            monkeypatch.setattr(paged_decode, "RingWindow", lambda *a: RingWindow(*a).keys())
        runs.append(prefill_then_decode(model, seqs))
    assert len(rings) == 3 * model.config.num_hidden_layers
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


@needs_kernel
@cpu_harness_only
def test_v4_decode_steps_through_the_kernel_meet_the_reference(monkeypatch):
    """v4-tiny decoding four sequences at positions that complete their CSA and HCA groups at
    different steps: with the decode kernel (the window ring and the compressed rows read where
    they lie) every layer of every step takes it, and the logits meet the full recompute as
    the torch path's do (fp32: summation order only). (CPU harness: under Triton's
    interpreter only; on CUDA tests/gpu/test_v4_cuda.py runs V4's decode against float32.)"""
    from atom.kernels import KERNELS
    from atom.models.deepseek_v4 import paged_decode
    from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from atom.models.deepseek_v4.presets import preset_config as v4_preset
    from tests.model.test_v4_paged import decode_four_meets_the_reference

    monkeypatch.setenv("ATOM_TRITON_OFF", ",".join(sorted(KERNELS - {"decode_attention"})))
    calls = []
    real = paged_decode.sink_attention_decode

    def counted(q, win_k, *rest):
        calls.append(isinstance(win_k, RingWindow))
        return real(q, win_k, *rest)

    monkeypatch.setattr(paged_decode, "sink_attention_decode", counted)
    model = DeepseekV4ForCausalLM(v4_preset("v4-tiny")).init_weights(0)
    decode_four_meets_the_reference(model, steps=6)
    assert calls == [True] * (6 * len(model.layers))
