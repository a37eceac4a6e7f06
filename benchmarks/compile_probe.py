"""A probe, not an engine path: v41-bench's roofline with each decoder layer's work around its
attention compiled by ``torch.compile`` (inductor), inside the decode CUDA graphs.

    python -m benchmarks.compile_probe --model v41-bench --device cuda --dtype bfloat16 \
        --position 2048 --batch 1 16 --decode-steps 16 --repeats 3 --prefill-repeats 1 \
        --name compile_probe_h200

Each layer runs as two compiled pieces, the Engram, the attention mixer and the attention's
input norm before the attention, and the mixer, the MoE and the FFN's mixer after it; the
attention itself runs as it does (dynamo could not trace it: it reads frozen dataclasses and
python lists of the plan). Inside a compiled piece the Triton kernels that have a torch
expression give way to it (the compiler fuses that expression with its neighbours; traced as
user kernels they failed to compile: a float scalar reached the RMSNorm kernel as float64).
The rest of the arguments and the output are ``benchmarks.roofline``'s. What it measured is in
benchmarks/results/compile_probe_h200.md.
"""

from __future__ import annotations

import time

import torch

import atom.kernels
from atom.models.common.mhc import collapse, hc_post
from atom.models.deepseek_v41.block import DecoderLayer
from benchmarks import roofline


def _before(layer, x, pre, rows):
    if layer.engram is not None:
        x = layer.engram(x, rows[:, layer.engram_index])
    attn_pre, post, comb = layer.attn_hc.mixes(x)
    return x, attn_pre, post, comb, layer.input_layernorm(collapse(x, pre))


def _after(layer, x, a, post, comb, attn_pre):
    x = hc_post(x, a, post, comb)
    ffn_pre, post, comb = layer.ffn_hc.mixes(x)
    out = layer.mlp(layer.post_attention_layernorm(collapse(x, attn_pre)))
    return hc_post(x, out, post, comb), ffn_pre


def install() -> dict:
    """Patch ``DecoderLayer.block`` with the compiled pieces; returns the seconds spent in
    layer calls (compiles included) under "seconds"."""
    torch._dynamo.config.cache_size_limit = 64
    importable = atom.kernels.triton_importable
    atom.kernels.triton_importable = lambda: not torch.compiler.is_compiling() and importable()
    before = torch.compile(_before, dynamic=False)
    after = torch.compile(_after, dynamic=False)
    spent = {"seconds": 0.0}

    def block(self, x, pre, engram_rows, attend, tap=None):
        if tap is not None:
            raise NotImplementedError("the probe compiles layers without a tap (no DSpark)")
        t0 = time.perf_counter()
        x, attn_pre, post, comb, u = before(self, x, pre, engram_rows)
        out = after(self, x, attend(u), post, comb, attn_pre)
        spent["seconds"] += time.perf_counter() - t0
        return out

    DecoderLayer.block = block
    return spent


if __name__ == "__main__":
    spent = install()
    roofline.main()
    print(f"seconds in layer calls, compiles included: {spent['seconds']:.1f}", flush=True)
