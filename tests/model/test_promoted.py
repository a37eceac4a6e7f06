"""``promoted``: float32 forms of weights computed once, recomputed when a weight changes, never
kept where keeping would be wrong (autograd, a graph capture, inference tensors)."""

import torch
from torch import nn

from atom.models.common import promoted as promoted_module
from atom.models.common.promoted import float_stacked, float_weight, promoted


def _linear():
    lin = nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    lin.weight.requires_grad_(False)
    return lin


def test_the_float_weight_is_computed_once_with_the_casts_bits():
    lin = _linear()
    first = float_weight(lin)
    assert first.dtype == torch.float32 and torch.equal(first, lin.weight.float())
    assert float_weight(lin) is first


def test_an_in_place_write_or_a_new_storage_recomputes_it():
    lin = _linear()
    first = float_weight(lin)
    with torch.no_grad():
        lin.weight.copy_(torch.ones(4, 8))  # a checkpoint load writes in place
    second = float_weight(lin)
    assert second is not first and torch.equal(second, torch.ones(4, 8))
    lin.weight.data = torch.full((4, 8), 2.0, dtype=torch.bfloat16)  # a replaced tensor
    assert torch.equal(float_weight(lin), torch.full((4, 8), 2.0))
    with torch.no_grad():
        lin.weight.mul_(3)  # any in-place op
    assert torch.equal(float_weight(lin), torch.full((4, 8), 6.0))


def test_stacked_weights_are_kept_and_follow_a_write_to_either():
    """``float_stacked``: the weights one below the other in float32 (one GEMM's weight for
    two projections of the same input), kept, recomputed when either weight changes."""
    owner, a, b = nn.Module(), _linear(), _linear()
    first = float_stacked(owner, "ab", a, b)
    assert torch.equal(first, torch.cat([a.weight.float(), b.weight.float()]))
    assert float_stacked(owner, "ab", a, b) is first
    with torch.no_grad():
        b.weight.fill_(5.0)
    second = float_stacked(owner, "ab", a, b)
    assert second is not first and torch.equal(second[4:], torch.full((4, 8), 5.0))


def test_under_autograd_the_product_stays_differentiable_and_is_not_kept():
    lin = nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    got = float_weight(lin)
    assert got.requires_grad and got.grad_fn is not None
    assert "_promoted" not in lin.__dict__
    with torch.no_grad():
        assert float_weight(lin) is float_weight(lin)


def test_nothing_is_kept_while_a_graph_is_captured(monkeypatch):
    """A tensor computed during a capture holds nothing until the graph replays: it is computed
    for the capture and not kept; the next eager call keeps its own."""
    lin = _linear()
    calls = []
    monkeypatch.setattr(promoted_module, "_capturing", lambda sources: True)
    compute = lambda: calls.append(1) or lin.weight.float()  # noqa: E731
    promoted(lin, "k", compute, lin.weight)
    promoted(lin, "k", compute, lin.weight)
    assert len(calls) == 2 and "k" not in lin.__dict__.get("_promoted", {})
    monkeypatch.setattr(promoted_module, "_capturing", lambda sources: False)
    kept = promoted(lin, "k", compute, lin.weight)
    assert promoted(lin, "k", compute, lin.weight) is kept and len(calls) == 3


def test_an_inference_tensor_is_never_kept():
    with torch.inference_mode():
        w = torch.ones(4, 8, dtype=torch.bfloat16)
    owner = nn.Module()
    calls = []
    for _ in range(2):
        promoted(owner, "k", lambda: calls.append(1) or w.float(), w)
    assert len(calls) == 2


def test_a_decode_step_casts_no_compressor_router_or_engram_weight():
    """v41-tiny in bfloat16: the first forward keeps the float32 forms its pooling compressors,
    routers and Engram take; the decode steps after it reuse those very tensors (no cast), and
    their logits equal those of steps that cast again (every kept form dropped first)."""
    from atom.models.common.moe import MoEGate
    from atom.models.deepseek_v41.attention import Compressor
    from atom.models.deepseek_v41.engram import Engram
    from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from atom.models.deepseek_v41.presets import preset_config
    from tests.model.harness import Harness
    from tests.model.test_paged_vs_reference import tokens

    model = DeepseekV41ForCausalLM(preset_config("v41-tiny"), dtype=torch.bfloat16)
    model = model.init_weights(0)
    seq = tokens(12, seed=5)

    def kept():
        return {
            (name, key): value
            for name, m in model.named_modules()
            for key, (_, value) in m.__dict__.get("_promoted", {}).items()
        }

    def run(drop: bool):
        h = Harness(model, block_size=32, num_slots=2)
        table = h.blocks(1)
        out = [h.step([(seq, 0, 8, 1, table)])]
        first = kept()
        for p in range(8, 11):
            if drop:
                for m in model.modules():
                    m.__dict__.pop("_promoted", None)
            out.append(h.step([(seq, p, p + 1, 1, table)]))
            if not drop:
                assert kept().keys() == first.keys()
                assert all(kept()[k] is v for k, v in first.items())
        return torch.stack(out), first

    reused, first = run(drop=False)
    owners = {type(model.get_submodule(name.rpartition(".")[0])) for name, _ in first}
    owners |= {type(model.get_submodule(name)) for name, _ in first}
    assert {Compressor, MoEGate, Engram} <= owners, owners
    recast, _ = run(drop=True)
    assert torch.equal(reused, recast)
