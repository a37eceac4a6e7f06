"""V4.1's draft layers in checkpoints: stored as decoder layers past the main ones
(``model.layers.{num_hidden_layers + i}.*``, DeepSeek style ``layers.{...}.*``), loaded by the
same loader with the same errors; a checkpoint's draft layers the model does not build are left
unread. Checkpoints are safetensors the tests write."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom.models.deepseek_v41.draft import reference_draft_forward
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.reference import reference_forward
from atom.models.deepseek_v41.weights import (
    WeightLoadError,
    checkpoint_tensors,
    deepseek_names,
    load_weights,
    save_weights,
)


@pytest.fixture(scope="module")
def draft_model():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-draft")).init_weights(0)


def fresh(**overrides):
    return DeepseekV41ForCausalLM(preset_config("v41-tiny-draft", **overrides)).init_weights(9)


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _rewrite(directory, edit):
    f = directory / "model.safetensors"
    tensors = load_file(str(f))
    edited = edit(tensors)
    tensors = edited if isinstance(edited, dict) else tensors
    save_file(tensors, str(f))
    return directory


def test_draft_tensors_roundtrip_in_both_namings(draft_model, tmp_path):
    save_weights(draft_model, tmp_path / "hf")
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(stored["model.layers.10.eh_proj.weight"], draft_model.mtp[0].eh_proj.weight)
    assert torch.equal(
        stored["model.layers.11.self_attn.kv_proj.weight"],
        draft_model.mtp[1].self_attn.kv_proj.weight,
    )
    assert not any(k.startswith("mtp.") for k in stored)
    hf = fresh()
    assert not torch.equal(hf.mtp[1].eh_proj.weight, draft_model.mtp[1].eh_proj.weight)
    load_weights(hf, tmp_path / "hf")
    assert_same_weights(hf, draft_model)
    names = deepseek_names(checkpoint_tensors(draft_model))
    assert set(names) == set(checkpoint_tensors(draft_model))  # the table covers every tensor
    assert names["model.layers.10.eh_proj.weight"] == "layers.10.eh_proj.weight"
    assert names["model.layers.11.head_hc.fn"] == "layers.11.hc_head_fn"
    assert names["model.layers.10.shared_head.norm.weight"] == "layers.10.shared_head.norm.weight"
    assert names["model.layers.11.self_attn.q_a_proj.weight"] == "layers.11.attn.wq_a.weight"
    save_weights(draft_model, tmp_path / "ds")
    _rewrite(tmp_path / "ds", lambda t: {names[k]: v for k, v in t.items()})
    ds = fresh()
    load_weights(ds, tmp_path / "ds")
    assert_same_weights(ds, draft_model)
    ids = torch.arange(1, 21)
    residual = torch.randn(20, 4, 64, generator=torch.Generator().manual_seed(0))
    a = reference_draft_forward(ds, ids, residual, 1)[0]
    assert torch.equal(a, reference_draft_forward(draft_model, ids, residual, 1)[0])


def test_missing_unexpected_and_misshaped_draft_tensors_are_named(draft_model, tmp_path):
    save_weights(draft_model, tmp_path)
    fresh_model = fresh()
    before = fresh_model.state_dict()["model.embed_tokens.weight"].clone()

    def edit(t):
        t.pop("model.layers.11.enorm.weight")
        t["model.layers.10.eh_proj.weight"] = torch.zeros(64, 64)
        t["model.layers.10.extra.weight"] = torch.zeros(3, 5)

    _rewrite(tmp_path, edit)
    with pytest.raises(WeightLoadError) as err:
        load_weights(fresh_model, tmp_path)
    msg = str(err.value)
    assert "missing tensor model.layers.11.enorm.weight (model expects shape [64])" in msg
    assert (
        "tensor model.layers.10.eh_proj.weight has shape [64, 64] in the checkpoint, "
        "the model expects [64, 128]" in msg
    )
    assert "unexpected tensor model.layers.10.extra.weight with shape [3, 5]" in msg
    assert torch.equal(fresh_model.model.embed_tokens.weight, before)  # nothing half-loaded


def test_deepseek_named_draft_errors_use_deepseek_names(draft_model, tmp_path):
    save_weights(draft_model, tmp_path)
    names = deepseek_names(checkpoint_tensors(draft_model))

    def edit(t):
        t = {names[k]: v for k, v in t.items()}
        t.pop("layers.10.hnorm.weight")
        return t

    _rewrite(tmp_path, edit)
    with pytest.raises(WeightLoadError, match=r"missing tensor layers.10.hnorm.weight \(model"):
        load_weights(fresh(), tmp_path)


def test_a_per_layer_copy_of_the_shared_head_is_refused(draft_model, tmp_path):
    save_weights(draft_model, tmp_path)
    _rewrite(
        tmp_path,
        lambda t: t.update(
            {"model.layers.10.shared_head.head.weight": t["lm_head.weight"].clone()}
        ),
    )
    with pytest.raises(
        WeightLoadError, match=r"unexpected tensor model.layers.10.shared_head.head.weight"
    ):
        load_weights(fresh(), tmp_path)


def test_draft_layers_the_model_does_not_build_are_left_unread(draft_model, tmp_path):
    save_weights(draft_model, tmp_path)
    one = fresh(num_nextn_predict_layers=1)
    load_weights(one, tmp_path)  # layer 11 (draft 1) is in the checkpoint, the model has none
    full = draft_model.state_dict()
    for name, t in one.state_dict().items():
        assert torch.equal(t, full[name]), name
    main = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(3)
    load_weights(main, tmp_path)  # neither draft layer is built: both unread
    ids = list(range(1, 25))
    assert torch.equal(reference_forward(main, ids), reference_forward(draft_model, ids))
    # a layer past the main ones without the draft tensors is no draft layer: refused
    _rewrite(tmp_path, lambda t: t.pop("model.layers.11.eh_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor model.layers.11.enorm.weight"):
        load_weights(fresh(num_nextn_predict_layers=1), tmp_path)
