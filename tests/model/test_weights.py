import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.weights import WeightLoadError, load_weights, save_weights
from atom.models.registry import load_runtime


def test_safetensors_roundtrip_and_registry_directory(tiny_model, tiny_config, tmp_path):
    save_weights(tiny_model, tmp_path)
    fresh = DeepseekV41ForCausalLM(tiny_config).init_weights(123)
    load_weights(fresh, tmp_path)
    for (n1, a), (n2, b) in zip(tiny_model.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    ids = list(range(1, 30))
    assert torch.equal(reference_forward(fresh, ids), reference_forward(tiny_model, ids))
    rt = load_runtime(
        str(tmp_path),
        dtype=torch.float32,
        kv_dtype="fp32",
        index_dtype="fp32",
        block_size=16,
        device="cpu",
        seed=999,
    )
    assert torch.equal(rt.model.lm_head.weight, tiny_model.lm_head.weight)


def test_hf_tensor_names(tiny_model):
    names = set(tiny_model.state_dict())
    for expected in [
        "model.embed_tokens.weight",
        "model.layers.2.self_attn.q_a_proj.weight",
        "model.layers.2.self_attn.compressor.wgate.weight",
        "model.layers.6.self_attn.indexer.wk.weight",
        "model.layers.8.self_attn.indexer.wq_b.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.4.engram.vocab_map",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        assert expected in names
    assert "model.layers.3.self_attn.compressor.wkv.weight" not in names  # REUSE owns none


def _tamper(tmp_path, model, edit):
    save_weights(model, tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    return tmp_path


def test_missing_tensor_is_named_with_its_shape(tiny_model, tiny_config, tmp_path):
    path = _tamper(tmp_path, tiny_model, lambda t: t.pop("model.layers.2.self_attn.kv_proj.weight"))
    with pytest.raises(
        WeightLoadError,
        match=r"missing tensor model.layers.2.self_attn.kv_proj"
        r".weight \(model expects shape \[64, 64\]\)",
    ):
        load_weights(DeepseekV41ForCausalLM(tiny_config), path)


def test_unexpected_tensor_is_named(tiny_model, tiny_config, tmp_path):
    path = _tamper(tmp_path, tiny_model, lambda t: t.update(extra=torch.zeros(3, 5)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor extra with shape \[3, 5\]"):
        load_weights(DeepseekV41ForCausalLM(tiny_config), path)


def test_misshaped_tensor_names_both_shapes_and_loads_nothing(tiny_model, tiny_config, tmp_path):
    def edit(t):
        t["lm_head.weight"] = torch.zeros(10, 64)

    path = _tamper(tmp_path, tiny_model, edit)
    target = DeepseekV41ForCausalLM(tiny_config).init_weights(5)
    before = target.model.embed_tokens.weight.clone()
    with pytest.raises(
        WeightLoadError,
        match=r"tensor lm_head.weight has shape \[10, 64\] in "
        r"the checkpoint, the model expects \[320, 64\]",
    ):
        load_weights(target, path)
    assert torch.equal(target.model.embed_tokens.weight, before)  # nothing half-loaded


def test_no_safetensors_in_directory(tiny_config, tmp_path):
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        load_weights(DeepseekV41ForCausalLM(tiny_config), tmp_path)
