"""benchmarks/shared_weights.py: engines of one benchmark run share one copy of equal weights.
A shared engine computes exactly what it computed with its own copy; a parameter whose values
differ (a draft layer another seed made) keeps its own copy."""

import pytest
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


def test_shared_experts_are_stacked_once_for_both_engines():
    """The engines' MoEs keep one stack of the shared experts: stacking through either engine
    finds it current and leaves it in place (apart, each restacked the experts and freed the
    other's stack, which that engine's CUDA graphs still read), and both engines still decode
    what they decoded alone."""
    first = LLM("v41-tiny-draft", **KW)
    second = LLM("v41-tiny-draft", **KW)
    alone = [o.token_ids for o in second.generate(PROMPTS, GREEDY)]
    src, dst = first.engine.runtime.model, second.engine.runtime.model
    share(src, dst)
    moes = [n for n, m in dst.named_modules() if hasattr(m, "share_stacks")]
    assert moes, "v41-tiny-draft has no MoE layer"
    with torch.no_grad():
        stacks = {n: src.get_submodule(n).stacked_weights() for n in moes}
        for model in (dst, src, dst):
            for n in moes:
                assert model.get_submodule(n).stacked_weights() is stacks[n], n
    for llm in (second, first):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    for n in moes:
        assert dst.get_submodule(n)._stack is stacks[n], n


def test_share_stacks_refuses_modules_with_other_experts():
    src = LLM("v41-tiny-draft", **KW).engine.runtime.model
    dst = LLM("v41-tiny-draft", **KW).engine.runtime.model
    name = next(n for n, m in dst.named_modules() if hasattr(m, "share_stacks"))
    with pytest.raises(ValueError, match="same expert parameters"):
        dst.get_submodule(name).share_stacks(src.get_submodule(name))
