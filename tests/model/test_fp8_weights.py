"""Weights at the precision a checkpoint ships (``weight_dtype: fp8``), on CPU.

The FP8 linears (``Fp8Linear``) compute the torch expression of the FP8 GEMM here: inputs
rounded to E4M3 per block, times the dequantized weight. So the stored-precision forward must
equal, bit for bit, the dequantized model whose same linears get their inputs rounded the same
way: that proves every FP8 linear is wired (a call site that read the E4M3 bytes as numbers,
or skipped a module, would part). The engine's paged path at stored precision must match the
reference forward of the same FP8 model, and a published FP8 checkpoint keeps its bytes.
"""

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import EngineConfig, EngineConfigError
from atom.models.common.formats import dequant_fp4, e8m0_to_float, fp8_act_sim
from atom.models.common.fp4_linear import Fp4Linear
from atom.models.common.fp8_linear import Fp8Linear, dequantize_linears, quantize_linears
from atom.models.common.layers import Linear
from atom.models.common.vocab_parallel import VocabHead
from atom.models.common.weights import WeightLoadError
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
from atom.models.deepseek_v4.presets import preset_config as v4_preset
from atom.models.deepseek_v4.reference import reference_forward as v4_reference
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config as v41_preset
from atom.models.deepseek_v41.reference import reference_forward as v41_reference
from atom.models.registry import FAMILIES, set_weight_precision

FAMS = {
    "v4-tiny-fp8": (DeepseekV4ForCausalLM, v4_preset, v4_reference, FAMILIES["deepseek_v4"]),
    "v41-tiny-fp8": (DeepseekV41ForCausalLM, v41_preset, v41_reference, FAMILIES["deepseek_v41"]),
}


def build(preset: str, weight_dtype: str):
    cls, preset_config, _, fam = FAMS[preset]
    net = cls(preset_config(preset), dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32")
    net.init_weights(0)
    count = set_weight_precision(net, fam, weight_dtype, random=True)
    return net.eval(), count


def prompt(n=70, seed=0):
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_published_fp8_linears_are_the_ones_converted():
    v4, n4 = build("v4-tiny-fp8", "fp8")
    kinds = {type(m).__name__ for n, m in v4.named_modules() if n.endswith(".attn.wq_b")}
    assert kinds == {"Fp8Linear"}
    # V4's grouped wo_a is read as a weight view, as DeepSeek's converter dequantizes it
    assert all(type(m) is Linear for n, m in v4.named_modules() if n.endswith("wo_a"))
    compressors = [m for n, m in v4.named_modules() if n.endswith(("compressor.wkv", "wgate"))]
    assert compressors and all(type(m) is Linear for m in compressors)
    shared = [m for n, m in v4.named_modules() if "shared_experts.gate_proj" in n]
    assert shared and all(isinstance(m, Fp8Linear) for m in shared)
    assert n4 == sum(isinstance(m, Fp8Linear) for m in v4.modules())
    v41, n41 = build("v41-tiny-fp8", "fp8")
    assert any(n.endswith("engram.wkv") for n, m in v41.named_modules() if isinstance(m, Fp8Linear))
    assert all(type(m) is Linear for n, m in v41.named_modules() if n.endswith("o_a_proj"))
    assert n41 > 0 and v41.lm_head.__class__ is VocabHead  # the dense head (bf16 as published)
    # the routed experts are FP4 as published: not FP8 linears
    assert not any(".experts." in n for n, m in v41.named_modules() if isinstance(m, Fp8Linear))


@pytest.mark.parametrize("preset", list(FAMS))
def test_stored_precision_equals_the_dequantized_model_with_inputs_rounded(preset, monkeypatch):
    """Every FP8 linear and every FP4 expert rounds its input to E4M3 per the FP8 K block (as
    DeepSeek's fp8_gemm and fp4_gemm take act_quant's output); the dequantized model with
    exactly those inputs rounded computes the same bits (both MoEs through the per-expert
    loop, so the hooks see every expert's input)."""
    from atom.models.common.moe import MoE

    monkeypatch.setattr(MoE, "DENSE_MAX_TOKENS", 0)
    fp8, count = build(preset, "fp8")
    dense, zero = build(preset, "bf16")
    assert count > 0 and zero == 0
    names = [n for n, m in fp8.named_modules() if isinstance(m, Fp8Linear)]
    block = fp8.get_submodule(names[0]).block
    for name in names:  # same weights, exactly
        q = fp8.get_submodule(name)
        assert torch.equal(dense.get_submodule(name).weight, q.dequantized())
    experts = [n for n, m in fp8.named_modules() if isinstance(m, Fp4Linear)]
    assert experts and all(fp8.get_submodule(n).act_block == block[1] for n in experts)
    ref = FAMS[preset][2]
    seq = prompt()
    with torch.no_grad():
        got = ref(fp8, seq)
        plain = ref(dense, seq)
        hooks = [
            dense.get_submodule(n).register_forward_pre_hook(
                lambda mod, args: (fp8_act_sim(args[0], block[1]),)
            )
            for n in names + experts
        ]
        want = ref(dense, seq)
    for h in hooks:
        h.remove()
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)  # the input rounding is what separates them


def test_quantize_then_dequantize_gives_the_same_model_and_refuses_bad_blocks():
    net, _ = build("v4-tiny-fp8", "bf16")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    names, block = FAMILIES["deepseek_v4"].get("fp8_linears")(net)
    assert block == (32, 32)
    assert quantize_linears(net, names, block) == len(names)
    assert dequantize_linears(net) == len(names)
    after = net.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # rounded once already
    with pytest.raises(ValueError, match=r"divisible by 48; not so for .*\(64\)"):
        quantize_linears(net, names, (48, 48))
    assert all(type(net.get_submodule(n)) is Linear for n in names)  # nothing changed


@pytest.mark.parametrize("preset", list(FAMS))
def test_the_engine_at_stored_precision_matches_its_oracle(preset):
    """In the batch-invariant mode the engine's greedy tokens and their logprobs are, bit for
    bit, what the reference forward of the same FP8 model computes for the context the engine
    had at each step. The mode is what makes this exact: at stored precision every linear
    rounds its input to E4M3, so in the default mode a float32 difference of the order of the
    GEMMs' row-count effects (other chunkings, other row counts) can cross a rounding boundary
    and move a logit far (0.8 at one position of v41-tiny-fp8), and which positions do depends
    on the host's float32 kernels (one token of 18 parted on a Sapphire Rapids host)."""
    llm = LLM(
        model=preset,
        weight_dtype="fp8",
        device="cpu",
        max_num_batched_tokens=64,
        batch_invariant=True,
    )
    assert llm.config.weight_dtype == "fp8"
    model = llm.engine.runtime.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    prompts = [prompt(40 + 17 * i, seed=i) for i in range(3)]
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1))
        ref = FAMS[preset][2]
        for p, out in zip(prompts, outs):
            for j, token in enumerate(out.token_ids):
                with torch.no_grad():
                    logits = ref(model, p + out.token_ids[:j])[-1].float()
                assert int(logits.argmax()) == token, (j, token)
                assert out.logprobs[j].token_id == token
                want = torch.log_softmax(logits, -1)[token].item()
                assert out.logprobs[j].logprob == want, (j, token)
    finally:
        llm.shutdown()


def test_weight_dtype_resolution_and_errors(monkeypatch):
    assert EngineConfig(model="v4-tiny-fp8", device="cpu").resolved().weight_dtype == "bf16"
    assert EngineConfig(model="v4-tiny", device="cpu").resolved().weight_dtype == "bf16"
    forced = EngineConfig(model="v41-tiny", device="cpu", weight_dtype="fp8").resolved()
    assert forced.weight_dtype == "fp8"
    # across ranks as on one: fp8 is kept, auto keeps stored FP8 on a GPU and dequantizes on CPU
    for tp in (1, 2, 4):
        kw = dict(model="v4-tiny-fp8", tensor_parallel_size=tp)
        assert EngineConfig(**kw, weight_dtype="fp8", device="cpu").resolved().weight_dtype == "fp8"
        assert EngineConfig(**kw, device="cpu").resolved().weight_dtype == "bf16"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolution only
        assert EngineConfig(**kw, device="cuda").resolved().weight_dtype == "fp8"
        assert EngineConfig(model="v4-tiny", tensor_parallel_size=tp, device="cuda").resolved(
        ).weight_dtype == "bf16"  # fmt: skip
        monkeypatch.undo()
    with pytest.raises(EngineConfigError, match="weight_dtype"):
        EngineConfig.build(model="v4-tiny", weight_dtype="int4")


def test_a_published_fp8_checkpoint_keeps_its_bytes(tmp_path):
    from safetensors import safe_open

    from .test_v4_checkpoint import write_checkpoint

    cfg = dict(
        __import__("atom.models.deepseek_v4.presets", fromlist=["PRESETS"]).PRESETS["v4-tiny"],
        expert_dtype="fp4",
        quantization_config=dict(quant_method="fp8", weight_block_size=[32, 32]),
    )
    write_checkpoint(tmp_path / "ckpt", config=cfg, block=(32, 32))
    llm = LLM(model=str(tmp_path / "ckpt"), weight_dtype="fp8", device="cpu")
    model = llm.engine.runtime.model
    stored = {}
    for f in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            stored.update({k: sf.get_tensor(k) for k in sf.keys()})
    q = model.get_submodule("layers.2.attn.wq_b")
    assert isinstance(q, Fp8Linear)
    raw = stored["layers.2.attn.wq_b.weight"]
    assert torch.equal(q.weight.view(torch.uint8), raw.view(torch.uint8))
    assert torch.equal(q.weight_scale, e8m0_to_float(stored["layers.2.attn.wq_b.scale"]))
    # the FP4 routed experts hold the checkpoint's bytes: codes and E8M0 scales
    e = model.get_submodule("layers.1.ffn.experts.2.down_proj")
    assert isinstance(e, Fp4Linear) and e.weight.dtype == torch.uint8
    codes, scale = (stored[f"layers.1.ffn.experts.2.w2.{k}"] for k in ("weight", "scale"))
    assert torch.equal(e.weight, codes.view(torch.uint8))
    assert torch.equal(e.weight_scale, scale.view(torch.uint8))
    assert torch.equal(e.dequantized(), dequant_fp4(codes, scale))


def test_an_fp4_expert_stored_dequantized_loads_only_if_its_values_are_fp4(tmp_path):
    """An expert a re-export stores in bf16 loads into its ``Fp4Linear`` quantized, when its
    values are FP4 values (exactly); other values are refused, naming the tensor."""
    from atom.models.deepseek_v4.presets import PRESETS as V4
    from atom.models.registry import load_runtime

    from .test_v4_checkpoint import write_checkpoint

    cfg = dict(V4["v4-tiny"], expert_dtype="fp4")
    cfg["quantization_config"] = dict(quant_method="fp8", weight_block_size=[32, 32])
    name, param = "layers.1.ffn.experts.2.w2", "layers.1.ffn.experts.2.down_proj"
    kw = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", block_size=16)
    exact = write_checkpoint(tmp_path / "a", config=cfg, block=(32, 32))
    value = exact[f"{param}.weight"]
    for directory, stored in (("a", value), ("b", value * 1.01)):
        extra = {f"{name}.weight": stored.to(torch.bfloat16)}
        write_checkpoint(
            tmp_path / directory, config=cfg, block=(32, 32), extra=extra, drop=[f"{name}.scale"]
        )
    model = load_runtime(str(tmp_path / "a"), device="cpu", seed=0, weight_dtype="fp8", **kw)
    expert = model.model.get_submodule(param)
    assert isinstance(expert, Fp4Linear) and torch.equal(expert.dequantized(), value)
    with pytest.raises(WeightLoadError, match=f"tensor {name}.weight holds values that are not"):
        load_runtime(str(tmp_path / "b"), device="cpu", seed=0, weight_dtype="fp8", **kw)


def test_an_unquantized_checkpoint_asked_for_fp8_is_quantized_at_load(tmp_path):
    """``weight_dtype fp8`` on a checkpoint that stores plain float weights (no
    quantization_config) quantizes its linears once loaded, exactly as a preset of the same
    weights is quantized: the same E4M3 bytes and scales, the same forward; bf16 keeps the
    checkpoint's values."""
    from atom.models.deepseek_v41.weights import save_weights
    from atom.models.registry import load_runtime

    plain = DeepseekV41ForCausalLM(
        v41_preset("v41-tiny"), dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32"
    ).init_weights(0)
    save_weights(plain, tmp_path)
    kw = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", block_size=16)
    loaded = load_runtime(str(tmp_path), device="cpu", seed=5, weight_dtype="fp8", **kw).model
    preset = load_runtime("v41-tiny", device="cpu", seed=0, weight_dtype="fp8", **kw).model
    fp8 = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 and fp8.keys() == {n for n, m in preset.named_modules() if isinstance(m, Fp8Linear)}
    for name, m in fp8.items():
        other = preset.get_submodule(name)
        assert m.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(m.weight.view(torch.uint8), other.weight.view(torch.uint8)), name
        assert torch.equal(m.weight_scale, other.weight_scale), name
    ids = prompt(40)
    with torch.no_grad():
        assert torch.equal(v41_reference(loaded, ids), v41_reference(preset, ids))
    kept = load_runtime(str(tmp_path), device="cpu", seed=5, weight_dtype="bf16", **kw).model
    assert not any(isinstance(m, Fp8Linear) for m in kept.modules())
    assert torch.equal(
        kept.model.layers[0].self_attn.q_a_proj.weight,
        plain.model.layers[0].self_attn.q_a_proj.weight,
    )
