"""v41-bench-draft is v41-bench plus one draft layer, and its target weights are v41-bench's bit
for bit (same seed): ``init_weights`` draws the target's tensors first, in the same order and
shapes, and the draft layer's after them. v41-bench itself (6.05 B parameters) is too large to
build in a test; here its structure is compared on the meta device and the draws on a
scaled-down copy of both configs (the same overrides on each)."""

import torch

from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import PRESETS, preset_config

# bench's layer pattern and modes, small dimensions
SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    num_attention_heads=8,  # o_groups 8 divides it
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=8,
    candidate_topk_blocks=4,
    moe_intermediate_size=32,
    engram_vocab_size=64,
    engram_n_heads=2,
    engram_head_dim=32,
)


def build(name: str, device: str = "cpu", **overrides) -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM(preset_config(name, **overrides), device=device)


def test_bench_draft_config_is_bench_plus_one_draft_layer():
    bench, draft = preset_config("v41-bench").to_dict(), preset_config("v41-bench-draft").to_dict()
    assert bench.pop("num_nextn_predict_layers") == 0
    assert draft.pop("num_nextn_predict_layers") == 1
    assert bench == draft
    assert PRESETS["v41-bench"].get("num_nextn_predict_layers") == 0  # bench stays without


def test_bench_draft_target_tensors_match_bench_in_draw_order():
    """Full size, on the meta device: the same target tensors (names, shapes, dtypes) in the
    same order, the draft layer's only under ``mtp.``."""
    bench, draft = build("v41-bench", "meta"), build("v41-bench-draft", "meta")
    assert bench.num_draft_layers == 0 and draft.num_draft_layers == 1

    def shapes(model, params):
        return [(n, tuple(p.shape), p.dtype) for n, p in params]

    target = [(n, p) for n, p in draft.named_parameters() if not n.startswith("mtp.")]
    assert shapes(draft, target) == shapes(bench, bench.named_parameters())
    buffers = [(n, b) for n, b in draft.named_buffers() if not n.startswith("mtp.")]
    assert shapes(draft, buffers) == shapes(bench, bench.named_buffers())
    assert sum(p.numel() for p in draft.mtp.parameters()) > 0


def test_bench_draft_target_weights_bit_identical_scaled_down():
    bench = build("v41-bench", **SMALL).init_weights(0)
    draft = build("v41-bench-draft", **SMALL).init_weights(0)
    a, b = bench.state_dict(), draft.state_dict()
    assert [n for n in b if not n.startswith("mtp.")] == list(a)
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), name
    # the draft layer is drawn, not left at zero, and another seed changes the target
    assert draft.mtp[0].eh_proj.weight.std() > 0
    other = build("v41-bench-draft", **SMALL).init_weights(1)
    assert not torch.equal(other.lm_head.weight, draft.lm_head.weight)
