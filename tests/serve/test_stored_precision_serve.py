"""``python -m atom.serve --model DIR --weight-dtype fp8``: a checkpoint written in DeepSeek's
published layout (FP8 linears in 32 x 32 blocks, FP4 routed experts) served over HTTP at stored
precision computes what ``atom.LLM`` computes on the same directory at fp8, token for token."""

from __future__ import annotations

import httpx
import pytest

from atom import LLM, SamplingParams
from atom.models.common.fp4_linear import Fp4Linear
from atom.models.common.fp8_linear import Fp8Linear
from atom.tokenizer import ByteTokenizer
from tests.model.test_v4_checkpoint import write_checkpoint

from .conftest import ServeProcess

FLAGS = ["--weight-dtype", "fp8", "--block-size", "256", "--num-blocks", "32"]
FLAGS += ["--max-num-batched-tokens", "256"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from atom.models.deepseek_v4.presets import PRESETS

    cfg = dict(
        PRESETS["v4-tiny"],
        expert_dtype="fp4",
        quantization_config=dict(quant_method="fp8", weight_block_size=[32, 32]),
    )
    path = tmp_path_factory.mktemp("published") / "ckpt"
    write_checkpoint(path, config=cfg, block=(32, 32))
    return path


def test_a_published_checkpoint_serves_at_stored_precision(checkpoint):
    tok = ByteTokenizer()
    prompt = tok.encode("Stored precision, over HTTP: ")
    local = LLM(
        model=str(checkpoint),
        weight_dtype="fp8",
        block_size=256,
        num_blocks=32,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        dtype="float32",
        kv_dtype="fp32",
        index_dtype="fp32",
        device="cpu",
    )
    model = local.engine.runtime.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, Fp4Linear) for m in model.modules())
    want = local.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    local.shutdown()
    proc = ServeProcess("--model", str(checkpoint), *FLAGS)
    proc.wait_ready()
    name = httpx.get(f"{proc.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(
        f"{proc.url}/v1/completions",
        json={
            "model": name,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [tok.decode([t]) for t in want[0].token_ids]
    assert proc.terminate() == 0, proc.text()
