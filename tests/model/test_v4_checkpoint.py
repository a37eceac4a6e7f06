"""DeepSeek-V4 weights as shipped: a reduced checkpoint written here with the published names,
dtypes and formats (FP8 E4M3 + E8M0 128x128 tile scales, packed FP4 E2M1 experts + E8M0 scales
per 32 inputs, two shards, scales in the other shard), loaded through the real path."""

import json
import shutil

import pytest
import torch

from atom.models.deepseek_v4.checkpoint import FP4, FP8, expected_names, load_checkpoint
from atom.models.deepseek_v4.checkpoint_formats import unpack_fp4
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.presets import PRESETS, preset_config
from atom.models.deepseek_v4.reference import reference_forward
from atom.models.deepseek_v41.weights import WeightLoadError
from atom.models.registry import load_runtime

from .published_quant import quant_fp4, quant_fp8, save_shards
from .test_v4_paged import Harness, assert_matches, one_thread_fixture, tokens  # noqa: F401


def write_checkpoint(
    directory, seed=0, extra=None, drop=(), config=None, block=(128, 128), shape=None
):
    """A reduced V4 checkpoint as published (FP8 in ``block`` tiles); returns the exact weights
    it holds (by param). ``shape``: v4-tiny's fields changed (the model written and, unless
    ``config`` is given, its config.json)."""
    shape = shape or {}
    model = DeepseekV4ForCausalLM(preset_config("v4-tiny", **shape)).init_weights(seed)
    params = model.state_dict()
    shards, exact = ({}, {}), {}
    for name, (param, fmt) in expected_names(model).items():
        w = params[param].float()
        if fmt == FP8:
            q, s, exact[param] = quant_fp8(w, block)
        elif fmt == FP4:
            q, s, exact[param] = quant_fp4(w)
        else:
            q = params[param] if w.dtype != params[param].dtype else w
            q = q.to(torch.bfloat16) if name.endswith("weight") else q
            s, exact[param] = None, q.to(params[param].dtype)
        shards[0][name] = q.contiguous()
        if s is not None:
            shards[1][name.removesuffix(".weight") + ".scale"] = s
    # an MTP block beyond the config's num_nextn_predict_layers (1) is left unread
    shards[1]["mtp.1.e_proj.weight"] = torch.zeros(8, 8, dtype=torch.float8_e4m3fn)
    shards[0].update(extra or {})
    save_shards(directory, shards, drop)
    published = PRESETS["v4-flash"]["quantization_config"]
    cfg = dict(PRESETS["v4-tiny"], **shape, expert_dtype="fp4", quantization_config=published)
    (directory / "config.json").write_text(json.dumps(config or cfg))
    return exact


def assert_load_refused(directory, change, needle):
    """Loading a checkpoint written with ``change`` fails naming ``needle`` and leaves the
    model's weights untouched."""
    write_checkpoint(directory, **change)
    model = DeepseekV4ForCausalLM(preset_config("v4-tiny")).init_weights(9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightLoadError) as err:
        load_checkpoint(model, directory)
    assert needle in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched


def runtime_of(directory):
    return load_runtime(
        str(directory),
        dtype=torch.float32,
        kv_dtype="fp32",
        index_dtype="fp32",
        block_size=16,
        device="cpu",
        seed=0,
    )


def test_fp4_nibbles_low_first_with_sign():
    packed = torch.tensor([[0x21, 0x9F]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -6.0, -0.5]]


def test_published_names_and_formats_load_exactly(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt")
    rt = runtime_of(tmp_path / "ckpt")
    got = rt.model.state_dict()
    assert set(got) == set(exact)
    for name, value in exact.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    fp4 = got["layers.3.ffn.experts.1.gate_proj.weight"]
    assert fp4.unique().numel() > 8  # FP4 codes times per-32 scales
    tid = got["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int64 and "layers.0.ffn.gate.bias" not in got


def test_loaded_checkpoint_forward_paged_equals_oracle(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt", seed=3)
    rt = runtime_of(tmp_path / "ckpt")
    direct = DeepseekV4ForCausalLM(preset_config("v4-tiny"))
    direct.load_state_dict(exact)
    seq = tokens(45, seed=8)
    ref = reference_forward(rt.model, seq)
    assert torch.equal(ref, reference_forward(direct, seq))  # loaded == the values written
    h = Harness(rt.model)
    assert_matches(h.run_chunks(seq, [9, 16, 33, 45], slot=0, table=h.blocks(3)), ref)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(drop=["layers.2.attn.wkv.weight"]), "missing tensor layers.2.attn.wkv.weight"),
        (dict(drop=["layers.2.attn.wkv.scale"]), "layers.2.attn.wkv.scale is missing"),
        (
            dict(extra={"layers.2.attn.extra.weight": torch.zeros(2)}),
            "unexpected tensor layers.2.attn.extra.weight",
        ),
        (
            dict(extra={"layers.4.ffn.experts.0.w2.weight": torch.zeros(64, 32, dtype=torch.int8)}),
            "tensor layers.4.ffn.experts.0.w2.weight has packed shape [64, 32]",
        ),
        (
            dict(extra={"layers.1.attn.wq_a.weight": torch.zeros(32, 64, dtype=torch.int8)}),
            "stored as fp4; the published format is fp8",
        ),
        (dict(extra={"norm.weight": torch.zeros(65)}), "tensor norm.weight has shape [65]"),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, change, needle):
    assert_load_refused(tmp_path / "ckpt", change, needle)


def test_a_bf16_reexport_loads_too(tmp_path):
    """Tensors published as FP8/FP4 may arrive dequantized (DeepSeek's own converter writes
    wo_a as bf16): the stored dtype decides the decoding."""
    exact = write_checkpoint(tmp_path / "ckpt", seed=4)
    wo_a = exact["layers.1.attn.wo_a.weight"].to(torch.bfloat16)
    shutil.rmtree(tmp_path / "ckpt")
    exact = write_checkpoint(
        tmp_path / "ckpt",
        seed=4,
        extra={"layers.1.attn.wo_a.weight": wo_a},
        drop=["layers.1.attn.wo_a.scale"],
    )
    rt = runtime_of(tmp_path / "ckpt")
    assert torch.equal(rt.model.state_dict()["layers.1.attn.wo_a.weight"], wo_a.float())
