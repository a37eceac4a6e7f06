import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.weights import (
    WeightLoadError,
    deepseek_names,
    load_weights,
    save_weights,
)
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
        "model.layers.4.engram.embed.weight",
        "model.layers.4.engram.q_weight",
        "model.layers.0.attn_hc.scale",
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


def _deepseek_named(tiny_model, directory):
    """The tiny model's checkpoint written with DeepSeek's names (via the naming table)."""
    save_weights(tiny_model, directory)
    f = directory / "model.safetensors"
    names = deepseek_names(tiny_model.state_dict())
    tensors = {names[k]: v for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f))
    return tensors


def test_deepseek_named_checkpoint_loads_like_the_hf_named_one(tiny_model, tiny_config, tmp_path):
    names = deepseek_names(tiny_model.state_dict())
    assert set(names) == set(tiny_model.state_dict())  # the table covers every parameter
    assert len(set(names.values())) == len(names)
    assert names["model.layers.2.self_attn.q_a_proj.weight"] == "layers.2.attn.wq_a.weight"
    assert (
        names["model.layers.0.mlp.experts.3.down_proj.weight"] == "layers.0.ffn.experts.3.w2.weight"
    )
    assert names["model.layers.0.mlp.gate.e_score_correction_bias"] == "layers.0.ffn.gate.bias"
    save_weights(tiny_model, tmp_path / "hf")
    _deepseek_named(tiny_model, tmp_path / "ds")
    hf = DeepseekV41ForCausalLM(tiny_config).init_weights(1)
    ds = DeepseekV41ForCausalLM(tiny_config).init_weights(2)
    load_weights(hf, tmp_path / "hf")
    load_weights(ds, tmp_path / "ds")
    for (n1, a), (n2, b) in zip(hf.state_dict().items(), ds.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    ids = list(range(1, 30))
    assert torch.equal(reference_forward(ds, ids), reference_forward(tiny_model, ids))


def test_deepseek_named_errors_use_deepseek_names(tiny_model, tiny_config, tmp_path):
    tensors = _deepseek_named(tiny_model, tmp_path)
    tensors.pop("layers.2.attn.wkv.weight")
    tensors["layers.1.ffn.gate.weight"] = torch.zeros(3, 3)
    tensors["model.norm.weight"] = tensors["norm.weight"].clone()  # one tensor in both styles
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as err:
        load_weights(DeepseekV41ForCausalLM(tiny_config), tmp_path)
    msg = str(err.value)
    assert "missing tensor layers.2.attn.wkv.weight (model expects shape [64, 64])" in msg
    assert "tensor layers.1.ffn.gate.weight has shape [3, 3] in the checkpoint" in msg
    assert "stored twice" in msg and "model.norm.weight" in msg
