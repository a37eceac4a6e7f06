"""tools/train_draft_adapter.py on CPU with v41-tiny-draft: a run writes an adapter the engine
applies, a resumed run continues from it (its agreement before is the first run's after, its
step count adds on), and a run index used before is refused."""

import json

import pytest
import torch

from atom.models.deepseek_v41 import draft_adapter as da
from tools import train_draft_adapter as tda

ARGS = [
    "--model", "v41-tiny-draft", "--device", "cpu", "--prompts", "8", "--eval-prompts", "4",
    "--prompt-len", "32", "--gen-len", "32", "--batch", "4", "--concurrency", "8",
    "--lr", "3e-3", "--log-every", "100",
]  # fmt: skip


def test_runs_train_write_and_resume(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    assert tda.main(ARGS + ["--out", str(first), "--max-steps", "30"]) == 0
    state = json.loads((first / "train_state.json").read_text())
    run = state["runs"][0]
    assert state["steps"] == 30 and run["steps"] == 30
    assert run["loss_last_10"] < run["loss_first"]  # it learned the training sequences
    tensors, meta = da.read_adapter(first / "adapter.safetensors")
    assert json.loads(meta["recipe"])["steps"] == 30
    assert all(t.dtype == torch.float32 for t in tensors.values())  # the model's dtype on CPU

    import benchmarks.common

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert tda.main(ARGS + ["--out", str(second), "--resume", str(first), "--run", "1",
                            "--max-steps", "5", "--name", "train_cpu"]) == 0  # fmt: skip
    md = (tmp_path / "results" / "train_cpu.md").read_text()
    assert "| 0 | 30 |" in md and "| 1 | 5 |" in md  # every run so far
    state = json.loads((second / "train_state.json").read_text())
    assert state["steps"] == 35 and [r["run"] for r in state["runs"]] == [0, 1]
    assert state["runs"][1]["agreement_before"] == run["agreement_after"]

    with pytest.raises(SystemExit, match="--run 1 was used already"):
        tda.main(ARGS + ["--out", str(tmp_path / "c"), "--resume", str(second), "--run", "1"])

    from atom import LLM, SamplingParams

    llm = LLM(
        "v41-tiny-draft", device="cpu", dtype="float32", block_size=16, num_blocks=32,
        speculative_tokens=1, draft_adapter=str(second / "adapter.safetensors"),
    )  # fmt: skip
    out = llm.generate([list(range(40))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8 and llm.engine.stats()["speculative"]["draft_tokens"] > 0
