"""The namespace every stored object is keyed under: deployments that differ in a byte-moving
field never share an object, equal deployments always do (real LMCache server for the
end-to-end part, plain calls of ``namespace`` for the rest)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from atom.config import EngineConfigError
from atom.model_api import StateSpec
from atom.tier.config import OffloadConfig, model_identity, namespace

from .conftest import BLOCK
from .test_two_pass import GREEDY, ceiling, prompts_of, tier

SPEC = StateSpec(
    block_size=BLOCK,
    block_bytes=12288,
    state_bytes=24576,
    layout_id="89dc1fb2b330148512b59adf5f69f5bd",
    header_offset=23616,
)
BASE = dict(
    model="v41-tiny",
    revision="",
    spec=SPEC,
    weights="seed=0",
    chunk_size=BLOCK,
    world_size=1,
)


def check(engine) -> None:
    engine.check_integrity()


# ---- end to end ---------------------------------------------------------------------------


def test_another_geometry_never_hits_the_same_geometry_does(lmcache_server, make_llm):
    prompts = prompts_of([40, 77, 100, 64], seed=301)
    first = make_llm(**tier(lmcache_server))  # v41-tiny: fp32 KV, fp32 index
    out1 = first.generate(prompts, GREEDY, on_step=check)
    ns = first.engine.tier_health()["namespace"]
    assert ns == namespace(**{**BASE, "spec": first.engine.spec})
    first.shutdown()  # its stores drain

    for change in (dict(kv_dtype="bf16"), dict(index_dtype="bf16")):
        other = make_llm(**tier(lmcache_server), **change)
        assert other.engine.spec.layout_id != first.engine.spec.layout_id
        assert other.engine.tier_health()["namespace"] != ns
        out = other.generate(prompts, GREEDY, on_step=check)
        assert [o.tier_hit_tokens for o in out] == [0] * len(prompts), change
        conn = other.engine.scheduler.connector
        # the lookups were answered (a miss), not lost: the namespace is what kept them apart
        assert conn.tier_metrics.lookups.get(outcome="miss") == len(prompts)
        assert conn.tier_metrics.loads.total() == 0
        other.shutdown()

    third = make_llm(**tier(lmcache_server))  # the first one's geometry
    assert third.engine.tier_health()["namespace"] == ns
    out3 = third.generate(prompts, GREEDY, on_step=check)
    assert [o.tier_hit_tokens for o in out3] == [ceiling(len(p)) for p in prompts]
    assert [o.token_ids for o in out3] == [o.token_ids for o in out1]


def test_a_preset_with_other_weights_never_hits(lmcache_server, make_llm):
    prompts = prompts_of([40, 77, 100, 64], seed=311)
    first = make_llm(**tier(lmcache_server))  # v41-tiny, weights from seed 0
    first.generate(prompts, GREEDY, on_step=check)
    first.shutdown()
    reference = make_llm(seed=1).generate(prompts, GREEDY)  # other weights, no tier
    other = make_llm(**tier(lmcache_server), seed=1)
    out = other.generate(prompts, GREEDY, on_step=check)
    assert [o.token_ids for o in out] == [o.token_ids for o in reference]
    assert [o.tier_hit_tokens for o in out] == [0] * len(prompts)


# ---- the namespace function -------------------------------------------------------------------


def test_namespace_is_stable_and_readable():
    ns = namespace(**BASE)
    assert ns == namespace(**dict(BASE)) == namespace(**{**BASE, "spec": replace(SPEC)})
    assert re.fullmatch(r"atom-v41-tiny#[0-9a-f]{20}", ns)
    assert "@" not in ns  # LMCache refuses '@' in a model name


def test_namespace_is_the_same_in_another_process():
    code = (
        "import json, sys\n"
        "from atom.tier.config import namespace\n"
        "from atom.model_api import StateSpec\n"
        "args = json.loads(sys.argv[1])\n"
        "args['spec'] = StateSpec(**args['spec'])\n"
        "print(namespace(**args))\n"
    )
    args = {**BASE, "spec": SPEC.__dict__}
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == namespace(**BASE)


@pytest.mark.parametrize(
    "change",
    [
        dict(model="v41-mini"),
        dict(revision="r2"),
        dict(spec=replace(SPEC, layout_id="0" * 32)),
        dict(spec=replace(SPEC, block_bytes=SPEC.block_bytes * 2)),
        dict(spec=replace(SPEC, state_bytes=SPEC.state_bytes + 64)),
        dict(chunk_size=2 * BLOCK),
        dict(world_size=2),
        dict(tp_size=2),
        dict(rank_collapse=True),
        dict(spec=replace(SPEC, speculative_tokens=1)),
    ],
    ids=lambda c: next(iter(c)) if "spec" not in c else "spec",
)
def test_namespace_differs_when_a_hashed_field_differs(change):
    assert namespace(**{**BASE, **change}) != namespace(**BASE)


def test_every_hashed_field_gives_its_own_namespace():
    variants = [
        dict(model="v41-mini"),
        dict(revision="r2"),
        dict(spec=replace(SPEC, layout_id="0" * 32)),
        dict(chunk_size=2 * BLOCK),
        dict(world_size=2),
        dict(tp_size=2, world_size=2),
        dict(tp_size=2, rank_collapse=True),
        dict(spec=replace(SPEC, speculative_tokens=1)),
    ]
    names = {namespace(**{**BASE, **v}) for v in variants} | {namespace(**BASE)}
    assert len(names) == len(variants) + 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_value_that_cannot_be_hashed_stably_is_refused(bad):
    with pytest.raises(EngineConfigError, match="cannot be hashed stably"):
        namespace(**{**BASE, "spec": replace(SPEC, block_bytes=bad)})
    with pytest.raises(EngineConfigError, match="cannot be hashed stably"):
        namespace(**{**BASE, "spec": replace(SPEC, speculative_tokens=bad)})


def test_model_directory_path_does_not_split_the_namespace(tmp_path):
    a, b, c = tmp_path / "a" / "mymodel", tmp_path / "b" / "mymodel", tmp_path / "b" / "other"
    for d in (a, b, c):
        d.mkdir(parents=True)
    assert model_identity(str(a)) == model_identity(str(b)) == "mymodel"
    assert model_identity(str(a) + "/") == "mymodel"
    ns_a = namespace(**{**BASE, "model": str(a)})
    assert ns_a == namespace(**{**BASE, "model": str(b)})
    assert ns_a.startswith("atom-mymodel#")
    assert ns_a != namespace(**{**BASE, "model": str(c)})  # another basename is another model
    assert model_identity("v41-tiny") == "v41-tiny"  # a preset is its name


def test_model_directory_given_relative_to_the_cwd_keeps_its_namespace(tmp_path, monkeypatch):
    d = tmp_path / "mymodel"
    d.mkdir()
    monkeypatch.chdir(d)
    assert model_identity(".") == model_identity(str(d)) == "mymodel"
    assert namespace(**{**BASE, "model": "."}) == namespace(**{**BASE, "model": str(d)})


def test_rank_collapse_resolves_auto_by_the_model_and_refuses_true_where_bytes_differ():
    auto, on, off = (OffloadConfig(tp_rank_collapse=v) for v in ("auto", "true", "false"))
    assert auto.rank_collapse(2, rank_replicated=True) is True
    assert auto.rank_collapse(2, rank_replicated=False) is False
    assert off.rank_collapse(4, rank_replicated=True) is False
    assert on.rank_collapse(2, rank_replicated=True) is True
    assert auto.rank_collapse(1, rank_replicated=True) is False  # one rank: nothing to collapse
    assert (auto.world_size(4, True), off.world_size(4, True)) == (1, 4)
    with pytest.raises(EngineConfigError, match="tp_rank_collapse=true.*differ per rank"):
        on.rank_collapse(2, rank_replicated=False)
