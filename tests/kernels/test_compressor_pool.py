"""The compressor-pool kernel against its torch expression: the same partial rows and overlap
fields written, the pooled values to float32 rounding; V4's decode through it. Skipped where no
kernel can run."""

import pytest
import torch

import atom.kernels.compressor_pool as pool_module
from atom.kernels.compressor_pool import compressor_pool, compressor_pool_torch
from tests.kernels.runnable import DEVICE, cpu_harness_only, needs_kernel, refuse_fallback

pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """The kernel may not fall back to its torch expression here."""
    refuse_fallback(monkeypatch, pool_module, "compressor_pool_torch", "compressor_pool")


def _case(r: int, d: int, overlap: bool, positions: list[int], seed: int):
    """State planes as a slot's bytes hold them (views with row strides past their width) and
    one decode token per sequence at ``positions``; partial rings of r + 1 rows; an ape."""
    g = torch.Generator().manual_seed(seed)
    w, rows, slots_n, entries = (2 * d if overlap else d), r + 1, 6, 2
    raw = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    partial = tuple(raw(slots_n, rows, w + 3)[..., :w] for _ in range(2))
    fields = tuple(raw(slots_n, entries, r, d) for _ in range(2)) if overlap else None
    pos = torch.tensor(positions, device=DEVICE)
    b = len(positions)
    slots = torch.randperm(slots_n, generator=g)[:b].to(DEVICE)
    group = pos // r
    extra = dict(
        prev_entry=(group - 1) % entries,
        own_entry=group % entries,
        first=group == 0,
        closes=(pos + 1) % r == 0,
    )
    args = (
        raw(b, w),
        raw(b, w),
        partial,
        slots,
        pos % rows,
        (group[:, None] * r + torch.arange(r, device=DEVICE)) % rows,
    )
    ape = (raw(r, w), pos % r)  # the score's position-in-group row, added first
    return args, ((fields, *extra.values()) if overlap else (None,) * 5) + ape


def _clone(args, rest):
    args = (*args[:2], tuple(p.clone() for p in args[2]), *args[3:])
    fields = None if rest[0] is None else tuple(f.clone() for f in rest[0])
    return args, (fields, *rest[1:])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("r,d", [(4, 48), (4, 128), (8, 64)])
def test_the_kernel_writes_the_same_state_and_pools_the_same_values(overlap, r, d):
    if overlap and r != 4:
        pytest.skip("only ratio 4 overlaps")
    positions = [0, 3, 5, 2 * r - 1, 9 * r + 2]  # group 0, completing groups, partial ones
    args, rest = _case(r, d, overlap, positions, seed=r * d)
    want_args, want_rest = _clone(args, rest)
    got = compressor_pool(*args, *rest)
    want = compressor_pool_torch(*want_args, *want_rest)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    for p, q in zip(args[2], want_args[2]):
        assert torch.equal(p, q)
    if overlap:
        for p, q in zip(rest[0], want_rest[0]):
            assert torch.equal(p, q)


@cpu_harness_only
def test_v4_decode_steps_through_the_kernel_meet_the_reference(monkeypatch):
    """v4-tiny decoding four sequences whose CSA (overlapping) and HCA groups complete at
    different steps, every compressor through the kernel (and the indexer's scores through
    theirs): the logits meet the full recompute."""
    from atom.models.deepseek_v4 import paged_decode
    from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from atom.models.deepseek_v4.presets import preset_config
    from tests.model.test_v4_paged import decode_four_meets_the_reference

    monkeypatch.setenv("ATOM_TRITON_OFF", "decode_attention,sink_attention")
    calls = []
    real = paged_decode.compressor_pool

    def counted(*a, **k):
        calls.append(k.get("overlap") is not None)
        return real(*a, **k)

    monkeypatch.setattr(paged_decode, "compressor_pool", counted)
    model = DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(0)
    decode_four_meets_the_reference(model, steps=6, seed=30)
    assert True in calls and False in calls  # CSA (overlap) and HCA compressors
