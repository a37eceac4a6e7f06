"""benchmarks/shared_weights.py: engines of one benchmark run share one copy of equal weights.
A shared engine computes exactly what it computed with its own copy; a parameter whose values
differ (a draft layer another seed made) keeps its own copy."""

import torch

from atom import LLM, SamplingParams
from benchmarks.shared_weights import share

from .test_speculative import KW

PROMPTS = [[(7 * i + 5 * j) % 256 for j in range(20 + 3 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_shared_engines_compute_what_their_own_copies_do():
    alone = [o.token_ids for o in LLM("v41-tiny-draft", speculative_tokens=1, **KW).generate(
        PROMPTS, GREEDY)]  # fmt: skip
    first = LLM("v41-tiny-draft", **KW)
    second = LLM("v41-tiny-draft", speculative_tokens=1, **KW)
    src, dst = first.engine.runtime.model, second.engine.runtime.model
    total = sum(p.numel() * p.element_size() for p in dst.parameters())
    freed = share(src, dst)
    assert freed == total  # one seed: every parameter equal, so every one shared
    mine = dict(dst.named_parameters(remove_duplicate=False))
    theirs = dict(src.named_parameters(remove_duplicate=False))
    assert all(mine[n] is theirs[n] for n in mine)
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == alone
    assert second.engine.stats()["speculative"]["draft_tokens"] > 0


def test_a_parameter_with_other_values_keeps_its_own_copy():
    src = LLM("v41-tiny-draft", **KW).engine.runtime.model
    dst = LLM("v41-tiny-draft", **KW).engine.runtime.model
    name, param = next(iter(dst.named_parameters()))
    with torch.no_grad():
        param.add_(1.0)
    total = sum(p.numel() * p.element_size() for p in dst.parameters())
    freed = share(src, dst)
    assert freed == total - param.numel() * param.element_size()
    assert dict(dst.named_parameters())[name] is param
    assert not torch.equal(param, dict(src.named_parameters())[name])
