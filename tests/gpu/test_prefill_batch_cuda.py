"""The batched prefill (all multi-token spans of a forward as one batch) on CUDA: several
sequences at different positions in one forward (with a decode token alongside) equal the
reference on the same device, in fp32 (1e-4, as on CPU) and bf16 (the CPU test's bf16
tolerance), with the Triton kernels on. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from atom.model_api import Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.runtime import V41Runtime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (sequence length, chunk ends): forwards carry 3-4 sequences' spans at different positions
PLANS = [(70, [16, 29, 70]), (53, [5, 53]), (40, [33, 37, 40]), (20, [19, 20])]


def _run(model, device):
    rt = V41Runtime(model, block_size=16)
    pool = torch.zeros(rt.spec.pool_shape(24), dtype=rt.spec.pool_dtype, device=device)
    slots = torch.zeros(5, rt.spec.state_bytes, dtype=torch.uint8, device=device)
    rt.bind(pool, slots)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n, _ in PLANS]
    tables = [torch.arange(5 * k, 5 * k + 5) for k in range(len(PLANS))]  # host tables
    got = {k: [] for k in range(len(PLANS))}
    starts = [0] * len(PLANS)
    for step in range(3):
        ids, spans, who = [], [], []
        for k, (_, ends) in enumerate(PLANS):
            if step < len(ends):
                s, e = starts[k], ends[step]
                ids.append(seqs[k][s:e])
                spans.append(Span(s, e, k, tables[k]))
                who.append(k)
                starts[k] = e
        out = model.forward_paged(torch.cat(ids), spans, rt.kv, rt.slots, all_logits=True)
        lo = 0
        for k, sp in zip(who, spans):
            got[k].append(out[lo : lo + sp.num_tokens].cpu())
            lo += sp.num_tokens
    return seqs, [torch.cat(got[k]) for k in range(len(PLANS))]


@pytest.mark.parametrize("dtype,kv", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_batched_prefill_on_cuda_matches_reference(dtype, kv):
    cfg = preset_config("v41-tiny")
    gpu = DeepseekV41ForCausalLM(cfg, dtype=dtype, kv_dtype=kv, index_dtype=kv, device="cuda")
    gpu.init_weights(0)
    seqs, paged = _run(gpu, "cuda")
    for seq, got in zip(seqs, paged):
        ref = reference_forward(gpu, seq.tolist()).cpu()
        if dtype == torch.float32:
            diff = (got - ref).abs().max().item()
            assert diff < 1e-4, f"max |paged - reference| = {diff}"
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
        else:
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < 0.05, rel
            assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
