"""The training forward is the model's function when top-k covers every compressed row."""

import torch

from atom.models.deepseek_v41.dense import dense_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward


def test_dense_forward_equals_reference_with_full_topk():
    cfg = preset_config("v41-tiny", index_topk=64, candidate_topk_blocks=64)
    model = DeepseekV41ForCausalLM(cfg).init_weights(4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (3, 50), generator=g)
    logits, kl = dense_forward(model, ids)
    for i in range(3):
        ref = reference_forward(model, ids[i].tolist())
        assert (logits[i] - ref).abs().max().item() < 1e-4
    assert kl.item() > 0 and kl.requires_grad


def test_dense_forward_trains_the_indexer_towards_attention():
    cfg = preset_config("v41-tiny", index_topk=64, candidate_topk_blocks=64)
    model = DeepseekV41ForCausalLM(cfg).init_weights(5)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(params, lr=3e-2)
    first = None
    for _ in range(12):
        _, kl = dense_forward(model, ids)
        first = first if first is not None else kl.item()
        opt.zero_grad()
        kl.backward()
        opt.step()
    assert kl.item() < 0.7 * first
