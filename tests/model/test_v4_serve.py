"""``python -m atom.serve --model <dir>`` serves a reduced DeepSeek-V4 checkpoint written with
the published names and formats; its greedy completion equals the oracle's."""

import httpx

from atom.models.deepseek_v4.reference import reference_generate
from tests.serve.conftest import ServeProcess

from .test_v4_checkpoint import runtime_of, write_checkpoint


def test_serve_a_published_format_checkpoint_directory(tmp_path):
    ckpt = tmp_path / "DeepSeek-V4-reduced"
    write_checkpoint(ckpt, seed=5)
    proc = ServeProcess("--model", str(ckpt))
    try:
        proc.wait_ready()
        prompt = "The quick brown fox jumps"
        model = httpx.get(f"{proc.url}/v1/models", timeout=10).json()["data"][0]["id"]
        assert model == str(ckpt)
        body = dict(model=model, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True)
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        usage = out["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 5)
    finally:
        assert proc.terminate() == 0, proc.text()
    want = reference_generate(runtime_of(ckpt).model, list(prompt.encode()), 5)
    text = bytes(t for t in want if t < 256).decode("utf-8", errors="replace")
    assert text and out["choices"][0]["text"] == text
