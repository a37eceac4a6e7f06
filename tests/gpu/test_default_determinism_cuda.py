"""The default mode (batch_invariant off) is bitwise repeatable run to run on CUDA in bfloat16:
the same requests through a fresh engine give the same tokens, logprobs and PAGE/image bytes,
in this process and in another one (decode steps replaying CUDA graphs), both families.

Repeatable is not batch-invariant: the same batches give the same bits, other batches may not.
What made earlier GPU runs differ run to run was that, not the kernels: with the tier on, a
lookup answering one step earlier or later changes which requests share a step (see
tests/gpu/tier_two_pass.py); without the tier the schedule, and with it every bit, repeats.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (40, 300, 530, 700, 1030, 90, 260, 610)


def digests(model: str, graphs: bool, device: str = "cuda") -> list[str]:
    """One digest per request: its tokens and top logprobs, and the bytes of every PAGE block
    (with its image) of its prompt the engine holds after the run."""
    from atom import LLM, SamplingParams
    from tests.engine.test_batch_invariant import prompt_bytes, prompts_of

    prompts = prompts_of(LENGTHS, seed=7)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)
    llm = LLM(
        model,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        num_blocks=96,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        cuda_graphs=graphs,
    )
    try:
        outs = llm.generate(prompts, params)
        found = []
        for prompt, out in zip(prompts, outs):
            h = hashlib.sha1(repr((out.token_ids, [lp.top for lp in out.logprobs])).encode())
            for page, image in prompt_bytes(llm, prompt):
                h.update(page)
                h.update(image or b"")
            found.append(h.hexdigest())
        return found
    finally:
        llm.shutdown()


def _other_process(model: str, graphs: bool) -> list[str]:
    code = (
        "import json, sys; from tests.gpu.test_default_determinism_cuda import digests; "
        f"print('DIGESTS ' + json.dumps(digests({model!r}, {graphs!r})))"
    )
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("DIGESTS ")]
    assert line, run.stdout[-2000:]
    return json.loads(line[-1][len("DIGESTS ") :])


@pytest.mark.parametrize("model", ["v41-mini", "v4-mini"])
def test_the_default_mode_repeats_its_bits_run_to_run(model):
    graphed = digests(model, graphs=True)
    assert digests(model, graphs=True) == graphed, "a second engine in this process differs"
    assert _other_process(model, graphs=True) == graphed, "another process differs"
