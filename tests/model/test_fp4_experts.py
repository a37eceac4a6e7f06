"""FP4 routed experts kept as stored (atom/models/common/fp4_linear.py): at weight_dtype fp8 the
routed experts of both families hold packed E2M1 codes and E8M0 scales, the dequantized twin
(weight_dtype bf16) holds exactly their values, and the two compute the same outputs; the FP4
quantizer round-trips FP4 values and refuses to keep other values as FP4."""

from __future__ import annotations

import pytest
import torch

from atom.models.common.formats import dequant_fp4, fp4_weight_quant, fp8_act_sim
from atom.models.common.fp4_linear import (
    Fp4Linear,
    dequantize_fp4_linears,
    experts_fp4,
    quantize_fp4_linears,
)
from atom.models.common.layers import Linear
from atom.models.common.moe import MoE

from .test_fp8_weights import FAMS, build, prompt


@pytest.mark.parametrize("preset", list(FAMS))
def test_the_routed_experts_are_fp4_at_stored_precision_and_their_values_in_bf16(preset):
    fp8, _ = build(preset, "fp8")
    dense, _ = build(preset, "bf16")
    assert experts_fp4(fp8.config)
    moes = [m for m in fp8.modules() if isinstance(m, MoE)]
    assert moes and all(m.fp4_experts() for m in moes)
    names = [n for n, m in fp8.named_modules() if isinstance(m, Fp4Linear)]
    experts = sum(len(m.experts) for m in moes)
    assert len(names) == 3 * experts  # gate, up, down of every routed expert, nothing else
    assert all(".experts." in n and "shared" not in n for n in names)
    for name in names:
        q = fp8.get_submodule(name)
        assert q.weight.dtype == torch.uint8 and q.weight_scale.dtype == torch.uint8
        assert q.weight.shape == (q.out_features, q.in_features // 2)
        twin = dense.get_submodule(name)
        assert type(twin) is Linear and torch.equal(twin.weight, q.dequantized())


@pytest.mark.parametrize("preset", list(FAMS))
def test_fp4_experts_compute_what_their_dequantized_twin_computes(preset, monkeypatch):
    """On CPU an FP4 expert's product is the dequantized one (the kernel's reference), so the
    model with FP4 experts and the same model with them dequantized, their inputs rounded to
    E4M3 as the FP4 experts round them, give the same bits (both through the per-expert loop:
    the dense path sums the experts in another order); unrounded, they part."""
    monkeypatch.setattr(MoE, "DENSE_MAX_TOKENS", 0)
    fp8, _ = build(preset, "fp8")
    ref = FAMS[preset][2]
    seq = prompt(50, seed=3)
    blocks = {n: m.act_block for n, m in fp8.named_modules() if isinstance(m, Fp4Linear)}
    assert blocks and all(b is not None for b in blocks.values())
    with torch.no_grad():
        got = ref(fp8, seq)
        assert dequantize_fp4_linears(fp8) > 0
        for m in fp8.modules():
            if isinstance(m, MoE):
                m._stack = None
                assert not m.fp4_experts() and m.path(len(seq), torch.zeros(1)) == "loop"
        unrounded = ref(fp8, seq)
        hooks = [
            fp8.get_submodule(n).register_forward_pre_hook(
                lambda mod, args, b=b: (fp8_act_sim(args[0], b),)
            )
            for n, b in blocks.items()
        ]
        want = ref(fp8, seq)
    for h in hooks:
        h.remove()
    assert torch.equal(got, want)
    assert not torch.equal(got, unrounded)


def test_moe_on_cpu_runs_fp4_experts_through_the_loop():
    fp8, _ = build("v41-tiny-fp8", "fp8")
    moe = next(m for m in fp8.modules() if isinstance(m, MoE))
    x = torch.zeros(3, fp8.config.hidden_size)
    assert moe.path(3, x) == "loop"  # the kernel needs CUDA (or Triton's interpreter)


def test_fp4_values_round_trip_and_other_values_are_refused():
    w = torch.randn(16, 64) * 3
    values = dequant_fp4(*fp4_weight_quant(w))
    assert torch.equal(dequant_fp4(*fp4_weight_quant(values)), values)
    net = torch.nn.Sequential(Linear(64, 16, bias=False), Linear(64, 16, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(values)
        net[1].weight.copy_(w)
    with pytest.raises(ValueError, match=r"not FP4 values cannot be kept as FP4: \['1'\]"):
        quantize_fp4_linears(net, ["0", "1"], exact=True)
    assert all(type(m) is Linear for m in net)  # refused before any replacement
    assert quantize_fp4_linears(net, ["0"], exact=True) == 1
    assert isinstance(net[0], Fp4Linear) and torch.equal(net[0].dequantized(), values)
    with pytest.raises(ValueError, match=r"divisible by 32 .*got 48"):
        Fp4Linear(48, 8, torch.float32)
