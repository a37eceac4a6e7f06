"""DeepSeek-V4.1-Flash weights as published: a reduced checkpoint written here in the published
names, dtypes and formats (FP8 E4M3 in 32 x 32 blocks with E8M0 scales, FP4 E2M1 routed experts
stored as ``float4_e2m1fn_x2`` with an E8M0 scale per 32 inputs, the Engram table in FP8 with a
scale per 32 values of a row, DSpark stages, a vision tower, two shards with the scales in the
other one) and a config.json in the published nested form, loaded through the real path."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from atom.models.common.checkpoint import FP4, FP8, FP8_ROWS
from atom.models.common.weights import WeightLoadError
from atom.models.deepseek_v41.config import V41Config
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.published_config import to_published
from atom.models.deepseek_v41.published_weights import UNREAD, published_names
from atom.models.deepseek_v41.reference import reference_forward, reference_generate
from atom.models.deepseek_v41.weights import load_weights
from tests.serve.conftest import ServeProcess

from .harness import Harness
from .published_quant import quant_fp4, quant_fp8, save_shards
from .test_v4_checkpoint import runtime_of  # the registry's loader, any family
from .test_v41_dspark import DSPARK

PUBLISHED = Path(__file__).resolve().parent.parent / "data" / "deepseek_v41_flash_config.json"


def published_tiny(dspark: bool = False, shape: dict | None = None) -> dict:
    """v41-tiny in the published config.json form, with the published quantization_config
    (so the published roundings are on) and vision_config; with ``dspark``, two DSpark
    stages; ``shape``: v41-tiny's fields changed."""
    shipped = json.loads(PUBLISHED.read_text())
    flat = preset_config("v41-tiny", **(DSPARK if dspark else {}), **(shape or {})).to_dict()
    for key in ("kv_fp8_sim", "compressed_fp4_sim", "index_fp4_sim", "act_fp8_sim"):
        flat.pop(key)  # as in the published file: the quantization_config turns them on
    out = to_published(flat)
    out["quantization_config"] = shipped["quantization_config"]
    out["vision_config"] = shipped["vision_config"]
    return out


def write_checkpoint(
    directory: Path, seed: int = 0, extra=None, drop=(), dspark: bool = False, shape=None
) -> dict:
    """Writes the reduced checkpoint; returns the exact values it holds, by parameter.
    ``shape``: v41-tiny's fields changed (``published_tiny``)."""
    config = V41Config.from_dict(published_tiny(dspark, shape))
    model = DeepseekV41ForCausalLM(config).init_weights(seed)
    params = model.state_dict()
    shards: tuple[dict, dict] = ({}, {})
    exact = {}
    for name, (param, fmt) in published_names(model).items():
        w = params[param].float()
        scale = None
        if fmt == FP8:
            q, scale, exact[param] = quant_fp8(w, (32, 32))
        elif fmt == FP8_ROWS:
            q, scale, exact[param] = quant_fp8(w, (1, 32))
        elif fmt == FP4:
            q, scale, exact[param] = quant_fp4(w, 32, torch.float4_e2m1fn_x2)
        elif name.endswith(".weight"):
            q = w.to(torch.bfloat16)
            exact[param] = q.float()
        else:
            q = exact[param] = w
        shards[0][name] = q.contiguous()
        if scale is not None:
            shards[1][name.removesuffix(".weight") + ".scale"] = scale
    # what a published checkpoint holds that atom leaves unread (stages past dspark_stages)
    if not dspark:
        shards[1]["mtp.0.main_proj.weight"] = torch.zeros(64, 192, dtype=torch.float8_e4m3fn)
        shards[1]["mtp.0.main_proj.scale"] = torch.zeros(2, 6, dtype=torch.float8_e8m0fnu)
    shards[1]["mtp.2.markov_head.embed.weight"] = torch.zeros(320, 16, dtype=torch.bfloat16)
    shards[0]["vision.blocks.0.attn.qkv.weight"] = torch.zeros(24, 8, dtype=torch.bfloat16)
    shards[0]["image_newline"] = torch.zeros(64, dtype=torch.bfloat16)
    shards[0]["layers.3.ffn.gate.bias_vl"] = torch.zeros(4)
    for name, value in (extra or {}).items():  # replaces a tensor where it is stored
        (shards[1] if name in shards[1] else shards[0])[name] = value
    save_shards(directory, shards, drop)
    (directory / "config.json").write_text(json.dumps(published_tiny(dspark, shape), indent=2))
    return exact


def test_published_names_and_formats_load_exactly(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt", seed=2)
    rt = runtime_of(tmp_path / "ckpt")
    c = rt.model.config
    assert c.act_fp8_sim and c.kv_fp8_sim and c.index_fp4_sim and c.compressed_fp4_sim
    got = rt.model.state_dict()
    assert set(got) == set(exact)
    for name, value in exact.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    fp4 = got["model.layers.3.mlp.experts.1.gate_proj.weight"]
    assert fp4.unique().numel() > 8  # FP4 codes times per-32 scales
    table = got["model.layers.1.engram.embed.weight"]  # FP8 rows, a scale per row here
    assert torch.log2(table.abs().amax(1)).floor().unique().numel() > 1  # rows' scales differ


def test_dspark_stages_load_exactly_from_the_mtp_tensors(tmp_path):
    exact = write_checkpoint(tmp_path / "ckpt", seed=6, dspark=True)
    model = runtime_of(tmp_path / "ckpt").model
    got = model.state_dict()
    assert set(got) == set(exact) and len(model.dspark) == 2
    for name, value in exact.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    stage0 = got["dspark.0.main_proj.weight"]  # FP8 in 32 x 32 blocks
    assert stage0.shape == (64, 192) and stage0.unique().numel() > 16
    assert "dspark.1.markov_embed.weight" in got and "dspark.0.markov_embed.weight" not in got


def test_loaded_checkpoint_paged_forward_equals_oracle(tmp_path):
    write_checkpoint(tmp_path / "ckpt", seed=3)
    model = runtime_of(tmp_path / "ckpt").model
    seq = torch.randint(3, 320, (45,), generator=torch.Generator().manual_seed(8)).tolist()
    ref = reference_forward(model, seq)
    h = Harness(model, block_size=16)
    paged = h.run_chunks(seq, [9, 16, 33, 45], slot=0, table=h.blocks(3), all_logits=True)
    assert torch.allclose(paged, ref, atol=1e-4, rtol=0), (paged - ref).abs().max()
    assert torch.equal(paged.argmax(-1), ref.argmax(-1))


def assert_refused(directory: Path, needle: str, **change) -> None:
    """Loading a checkpoint written with ``change`` fails naming ``needle``; nothing copied."""
    write_checkpoint(directory, **change)
    model = DeepseekV41ForCausalLM(V41Config.from_dict(published_tiny())).init_weights(9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightLoadError) as err:
        load_weights(model, directory)
    assert needle in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "change, needle",
    [
        (
            dict(drop=["layers.2.attn.wq_b.scale"]),
            "tensor layers.2.attn.wq_b.weight is fp8 but its scale layers.2.attn.wq_b.scale",
        ),
        (
            dict(extra={"layers.1.engram.embed.scale": torch.zeros(462, 2).to(torch.uint8)}),
            "tensor layers.1.engram.embed.weight has shape [462, 32] (scale [462, 2]), the "
            "model expects [462, 32] (scale [462, 1])",
        ),
        (
            dict(
                extra={
                    "layers.0.ffn.experts.0.w1.weight": torch.zeros(
                        32, 64, dtype=torch.float4_e2m1fn_x2
                    )
                }
            ),
            "tensor layers.0.ffn.experts.0.w1.weight has shape [32, 128] (scale [32, 2]), the "
            "model expects [32, 64] (scale [32, 2])",
        ),
        (dict(drop=["layers.4.engram.wkv.weight"]), "missing tensor layers.4.engram.wkv.weight"),
        (dict(extra={"layers.0.attn.surprise": torch.zeros(3)}), "unexpected tensor "),
        (
            dict(extra={"layers.0.attn.wo_a.weight": torch.zeros(64, 64, dtype=torch.int64)}),
            "tensor layers.0.attn.wo_a.weight is stored as i64; the published format is bf16",
        ),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, change, needle):
    assert_refused(tmp_path / "ckpt", needle, **change)


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    write_checkpoint(tmp_path / "ckpt")
    save_file({"norm.weight": torch.ones(64)}, str(tmp_path / "ckpt" / "extra.safetensors"))
    model = DeepseekV41ForCausalLM(V41Config.from_dict(published_tiny()))
    with pytest.raises(WeightLoadError, match="tensor norm.weight is stored twice, in "):
        load_weights(model, tmp_path / "ckpt")


def test_unread_tensors_have_reasons_and_mtp_style_drafts_are_refused(tmp_path, caplog):
    write_checkpoint(tmp_path / "ckpt")
    with caplog.at_level("INFO"):
        runtime_of(tmp_path / "ckpt")
    reasons = [reason for _, reason in UNREAD]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(reason in logged for reason in reasons), logged
    config = V41Config.from_dict(
        dict(
            published_tiny(),
            text_config=dict(published_tiny()["text_config"], num_nextn_predict_layers=1),
        )
    )
    with pytest.raises(WeightLoadError, match="DSpark draft stages"):
        load_weights(DeepseekV41ForCausalLM(config), tmp_path / "ckpt")


def test_the_fp8_block_comes_from_the_quantization_config(tmp_path):
    """A config whose weight_block_size disagrees with the stored scales is refused, naming the
    scale shape the config implies."""
    write_checkpoint(tmp_path / "ckpt")
    data = published_tiny()
    data["quantization_config"] = dict(data["quantization_config"], weight_block_size=[64, 64])
    model = DeepseekV41ForCausalLM(V41Config.from_dict(data))
    with pytest.raises(WeightLoadError, match=r"wq_a.weight has shape \[32, 64\] \(scale "):
        load_weights(model, tmp_path / "ckpt")


def test_serve_a_published_checkpoint_directory(tmp_path):
    """``python -m atom.serve --model DIR`` serves it; greedy output equals the oracle's."""
    ckpt = tmp_path / "DeepSeek-V4.1-reduced"
    write_checkpoint(ckpt, seed=5)
    proc = ServeProcess("--model", str(ckpt))
    try:
        proc.wait_ready()
        prompt = "The quick brown fox jumps"
        body = dict(model=str(ckpt), prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True)
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 5
        image = dict(
            model=str(ckpt),
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
        refused = httpx.post(f"{proc.url}/v1/chat/completions", json=image, timeout=30)
        assert refused.status_code == 400 and "image_url" in refused.text, refused.text
    finally:
        assert proc.terminate() == 0, proc.text()
    want = reference_generate(runtime_of(ckpt).model, list(prompt.encode()), 5)
    text = bytes(t for t in want if t < 256).decode("utf-8", errors="replace")
    assert text and out["choices"][0]["text"] == text
