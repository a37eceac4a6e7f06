"""lm-eval (0.4.13 with its api extra: ``pip install -e '.[eval]'``) against a running
atom.serve, as a user runs it: the ``local-completions`` model, token-id prompts from the shipped
tokenizer directory (``tokenizer_backend=huggingface``), ``--batch_size 4``, on two tiny local
tasks (one multiple_choice, scored by loglikelihood; one generate_until). Two passes give the
same scores and samples; every HTTP call carried a list of 4 prompts; the loglikelihoods and
generations lm-eval reports are the server's for the same ids. Skipped when lm_eval is not
installed (failed under CI=true, whose .ci/run installs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from atom.tokenizer import BYTE_TOKENIZER_DIR

from .conftest import _MODULE_SERVERS, ServeProcess

if os.environ.get("CI", "").lower() in ("1", "true", "yes") and find_spec("lm_eval") is None:
    pytest.fail("lm_eval is not installed (.ci/run installs it: pip install -e '.[eval]')")
pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[eval]'")
transformers = pytest.importorskip("transformers")

MODEL = "v41-tiny"
BATCH = 4
MC_DOCS = [  # 4 docs x 3 choices: 12 loglikelihood requests, 3 calls of 4
    {"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "The sky is", "choices": ["green", "blue", "loud"], "answer": 1},
    {"question": "Café en français:", "choices": ["coffee", "tea", "water"], "answer": 0},
    {"question": "日本の首都は", "choices": ["大阪", "京都", "東京"], "answer": 2},
]
GEN_DOCS = [  # 4 docs, one generation_kwargs: one call of 4
    {"prompt": "Count: 1 2 3", "target": " 4"},
    {"prompt": "Repeat: abc abc", "target": " abc"},
    {"prompt": "Héllo wörld", "target": "!"},
    {"prompt": "The end", "target": "."},
]
TASKS = {
    "atom_tiny_mc": """
task: atom_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "atom_tiny_gen": """
task: atom_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess()
    _MODULE_SERVERS.append(proc)
    proc.wait_ready()
    yield proc
    _MODULE_SERVERS.remove(proc)
    assert proc.terminate() == 0, proc.text()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, docs in (("atom_tiny_mc", MC_DOCS), ("atom_tiny_gen", GEN_DOCS)):
        data = d / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
        (d / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    return d


def metrics(server) -> tuple[float, float]:
    """(HTTP calls to /v1/completions answered 200, engine requests finished)."""
    calls = engine = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith('atom_http_requests_total{path="/v1/completions",status="200"}'):
            calls = float(line.rsplit(" ", 1)[1])
        elif line.startswith("atom_requests_total{"):
            engine += float(line.rsplit(" ", 1)[1])
    return calls, engine


def run_lm_eval(server, task_dir: Path, out: Path) -> tuple[dict, dict[str, list]]:
    """One `python -m lm_eval` run: its results and its samples by task."""
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={server.url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={BYTE_TOKENIZER_DIR}",
            "num_concurrent=1",
            "max_retries=1",  # a refused request fails the run at once
        ]
    )
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions", "--model_args", model_args,
        "--tasks", ",".join(TASKS), "--include_path", str(task_dir),
        "--batch_size", str(BATCH), "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(out / "hf-home"),  # datasets' cache of the jsonl: this run's own
        TOKENIZERS_PARALLELISM="false",
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{server.text()[-4000:]}"
    (results,) = out.glob("**/results_*.json")
    samples = {}
    for task in TASKS:
        (path,) = out.glob(f"**/samples_{task}_*.jsonl")
        lines = path.read_text(encoding="utf-8").splitlines()
        samples[task] = sorted((json.loads(x) for x in lines), key=lambda s: s["doc_id"])
    return json.loads(results.read_text())["results"], samples


def essentials(samples: dict[str, list]) -> dict[str, list]:
    return {
        t: [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in v] for t, v in samples.items()
    }


def test_lm_eval_local_completions_twice_gives_the_same_scores(server, task_dir, tmp_path):
    missing = [m for m in ("aiohttp", "requests", "tenacity", "tqdm") if find_spec(m) is None]
    assert not missing, f"lm-eval's api extra is missing {missing}: pip install -e '.[eval]'"
    n_ll = sum(len(d["choices"]) for d in MC_DOCS)
    want_calls = -(-n_ll // BATCH) + -(-len(GEN_DOCS) // BATCH)
    runs = []
    for i in range(2):
        before = metrics(server)
        runs.append(run_lm_eval(server, task_dir, tmp_path / f"pass{i}"))
        calls, engine = (a - b for a, b in zip(metrics(server), before))
        # lm-eval sends at most BATCH prompts a call: this many calls for this many prompts
        # means every call carried a list of exactly BATCH
        assert (calls, engine) == (want_calls, n_ll + len(GEN_DOCS)), (calls, engine)
        assert engine == BATCH * calls
    (res1, samples1), (res2, samples2) = runs
    assert res1 == res2
    assert essentials(samples1) == essentials(samples2)
    assert set(res1["atom_tiny_mc"]) >= {"acc,none", "acc_norm,none"}
    assert "exact_match,none" in res1["atom_tiny_gen"]
    assert [len(s["resps"]) for s in samples1["atom_tiny_mc"]] == [3] * len(MC_DOCS)

    # a loglikelihood lm-eval reports is the server's for the same ids (prompt only)
    hf = transformers.AutoTokenizer.from_pretrained(str(BYTE_TOKENIZER_DIR))
    sample = samples1["atom_tiny_mc"][3]  # non-ASCII context and choices
    for k, (args, resp) in enumerate(zip(sample["arguments"].values(), sample["resps"])):
        context, continuation = args["arg_0"], args["arg_1"]
        ctx, cont = hf.encode(context), hf.encode(continuation)
        body = {"model": MODEL, "prompt": ctx + cont, "max_tokens": 0, "echo": True, "logprobs": 1}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lps) == len(ctx) + len(cont)
        assert float(resp[0][0]) == pytest.approx(sum(lps[len(ctx) :]), rel=1e-4, abs=1e-4), k

    # its generations are the server's for the same call (lm-eval's order: longest context
    # first; its stop strings: the task's and the EOS token's string)
    order = sorted(range(len(GEN_DOCS)), key=lambda i: -len(GEN_DOCS[i]["prompt"]))
    body = {
        "model": MODEL,
        "prompt": [hf.encode(GEN_DOCS[i]["prompt"]) for i in order],
        "max_tokens": 8,
        "temperature": 0,
        "stop": ["\n", hf.eos_token],
        "seed": 1234,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    texts = {i: c["text"] for i, c in zip(order, r.json()["choices"])}
    assert [s["resps"][0][0] for s in samples1["atom_tiny_gen"]] == [
        texts[i] for i in range(len(GEN_DOCS))
    ]
