"""Draft adapters (``atom.models.deepseek_v41.draft_adapter``): a trained draft layer stored as its
init recipe plus low-rank deltas and small tensors. Applied to a fresh model of the same target
it reproduces the trained layer exactly; a file for another target, another seed, a model
without draft layers or a file that is not an adapter is refused with the reason."""

import pytest
import torch
from safetensors.torch import save_file

from atom.models.deepseek_v41 import draft_adapter as da
from atom.models.deepseek_v41.draft import reference_draft_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config


def build(name: str = "v41-tiny-draft", seed: int = 0, **overrides) -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM(preset_config(name, **overrides)).init_weights(seed)


def trained(model, rank: int = 4) -> dict[str, torch.Tensor]:
    """Give draft layer 0 an adapter whose every part differs from the init; returns the layer's
    effective weights (the parametrized ones read through)."""
    da.init_from_last_layer(model, 0, embed_rms=0.7, stream_rms=1.3)
    da.add_low_rank(model, 0, rank=rank, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in da.trainable(model, 0).values():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    block = model.mtp[0]
    out = {
        n: p.detach().clone() for n, p in block.named_parameters() if "parametrizations" not in n
    }
    for path in da.ADAPTED:
        out[f"{path}.weight"] = da.submodule(block, path).weight.detach().clone()
    return out


def test_applied_adapter_reproduces_the_trained_layer(tmp_path):
    model = build()
    want = trained(model)
    path = da.save_adapter(model, 0, tmp_path / "adapter.safetensors", {"steps": 3})
    fresh = build()
    meta = da.apply_adapter(fresh, path)
    assert meta["recipe"] == {"steps": 3} and meta["rank"] == "4"
    have = dict(fresh.mtp[0].named_parameters())
    assert set(have) == set(want)
    for name, value in want.items():
        assert torch.equal(have[name], value), name
    # the deltas and whole tensors moved the layer: it is not the plain init
    init = build()
    da.init_from_last_layer(init, 0)
    ids = torch.tensor([3, 7, 11, 5, 9])
    residual = torch.randn(5, fresh.config.hc_mult, fresh.config.hidden_size)
    a, _ = reference_draft_forward(fresh, ids, residual)
    b, _ = reference_draft_forward(init, ids, residual)
    assert not torch.allclose(a, b)


def test_init_copies_the_last_layer():
    model = build()
    da.init_from_last_layer(model, 0, embed_rms=0.5, stream_rms=2.0)
    block, last = model.mtp[0], model.model.layers[-1]
    assert torch.equal(block.self_attn.kv_proj.weight, last.self_attn.kv_proj.weight)
    assert torch.equal(block.mlp.gate.weight, last.mlp.gate.weight)
    assert torch.equal(block.head_hc.fn, last.ffn_hc.fn[: model.config.hc_mult])
    assert torch.all(block.enorm.weight == 0.5) and torch.all(block.hnorm.weight == 2.0)
    d = model.config.hidden_size
    assert torch.equal(block.eh_proj.weight, torch.cat([torch.eye(d), torch.eye(d)], 1))


def test_adapter_for_another_target_is_refused(tmp_path):
    model = build()
    trained(model)
    path = da.save_adapter(model, 0, tmp_path / "a.safetensors", {})
    other_seed = build(seed=1)
    before = {n: p.clone() for n, p in other_seed.mtp[0].named_parameters()}
    with pytest.raises(da.AdapterError, match="other target weights"):
        da.apply_adapter(other_seed, path)
    for n, p in other_seed.mtp[0].named_parameters():  # refused before any change
        assert torch.equal(p, before[n]), n
    with pytest.raises(da.AdapterError, match="sliding_window: adapter 8, model 32"):
        da.apply_adapter(build(sliding_window=32), path)
    with pytest.raises(da.AdapterError, match="has 0 draft layers"):
        da.apply_adapter(build("v41-tiny"), path)


def test_files_that_are_not_adapters_are_refused(tmp_path):
    model = build()
    with pytest.raises(da.AdapterError, match="does not exist"):
        da.apply_adapter(model, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(da.AdapterError, match="is not a safetensors file"):
        da.apply_adapter(model, tmp_path / "junk.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(da.AdapterError, match="is not a draft adapter"):
        da.apply_adapter(model, tmp_path / "plain.safetensors")
    trained(model)
    tensors = da.adapter_tensors(model, 0)
    tensors.pop("lowrank.eh_proj.b")
    meta = {
        "format": da.FORMAT,
        "layer": "0",
        "target": __import__("json").dumps(da.target_signature(model.config)),
        "fingerprint": repr(da.target_fingerprint(model)),
    }
    save_file(tensors, str(tmp_path / "short.safetensors"), metadata=meta)
    with pytest.raises(da.AdapterError, match=r"missing \['lowrank.eh_proj'\]"):
        da.apply_adapter(build(), tmp_path / "short.safetensors")


def test_engine_drafts_with_the_adapter_and_outputs_stay_exact(tmp_path):
    """The engine's draft layer is the adapter's (its drafts differ from the random layer's),
    outputs equal plain decoding, and the tier keys the adapter's objects apart."""
    from atom import LLM, SamplingParams
    from atom.config import EngineConfigError
    from atom.tier.config import weights_identity
    from tests.engine.test_speculative import KW as ENGINE

    model = build()
    trained(model)
    path = str(da.save_adapter(model, 0, tmp_path / "adapter.safetensors", {}))
    prompts = [[(7 * i + j) % 256 for j in range(20 + i)] for i in range(3)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM("v41-tiny-draft", **ENGINE).generate(prompts, greedy)]
    runs = {}
    for name, extra in (("random", {}), ("adapter", {"draft_adapter": path})):
        llm = LLM("v41-tiny-draft", speculative_tokens=2, **ENGINE, **extra)
        outs = llm.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == plain, name
        runs[name] = llm.engine.stats()["speculative"]
        assert runs[name]["draft_tokens"] > 0
    assert runs["adapter"] != runs["random"]  # another draft layer proposed other tokens
    assert weights_identity("v41-tiny-draft", 0, draft_adapter=path) != weights_identity(
        "v41-tiny-draft", 0
    )
    with pytest.raises(EngineConfigError, match="has no draft layer to adapt"):
        LLM("v41-tiny", draft_adapter=path, **ENGINE)
    with pytest.raises(EngineConfigError, match="deepseek_v4 model, whose family has no draft"):
        LLM("v4-tiny", draft_adapter=path, **ENGINE)
    with pytest.raises(EngineConfigError, match="no such file"):
        LLM("v41-tiny-draft", draft_adapter=str(tmp_path / "none"), **ENGINE)
