"""The GPU gate (``bash benchmarks/gpu/run.sh tests tier``: tests/gpu) runs every model family
the registry knows. V4 once crashed on CUDA unnoticed because no GPU test built it; this test
fails, on CPU, as soon as a family is registered without one."""

from __future__ import annotations

import ast
from pathlib import Path

from atom.models.registry import FAMILIES

GPU_TESTS = Path(__file__).resolve().parent.parent / "gpu"


def _family_package(model_path: str) -> str:
    """``atom.models.deepseek_v4.model:Cls`` -> ``atom.models.deepseek_v4``."""
    module = model_path.partition(":")[0]
    return module.rsplit(".", 1)[0]


def _gpu_test_imports() -> dict[str, set[str]]:
    """GPU test file -> the modules it imports, for files that define a test function."""
    out = {}
    for path in sorted(GPU_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        tests = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        ]
        if not tests:
            continue
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
            elif isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
        out[path.name] = mods
    return out


def test_every_registered_family_has_a_gpu_test():
    imports = _gpu_test_imports()
    assert imports, f"no GPU test files under {GPU_TESTS}"
    missing = []
    for model_type, fam in FAMILIES.items():
        pkg = _family_package(fam.model)
        users = [f for f, mods in imports.items() if any(m.startswith(pkg) for m in mods)]
        if not users:
            missing.append(f"{model_type} ({pkg})")
    assert not missing, (
        f"no test under tests/gpu builds {missing}: add one (the GPU gate must run every "
        "family on CUDA)"
    )


def test_the_coverage_check_sees_a_family_without_gpu_tests(monkeypatch):
    """The check can fail: a family whose package no GPU test imports is reported."""
    fake = {
        "nobody": FAMILIES["deepseek_v4"].__class__(
            **{
                **FAMILIES["deepseek_v4"].__dict__,
                "model_type": "nobody",
                "model": "atom.models.no_such_family.model:Model",
            }
        )
    }
    monkeypatch.setattr("tests.model.test_gpu_gate_coverage.FAMILIES", {**FAMILIES, **fake})
    try:
        test_every_registered_family_has_a_gpu_test()
    except AssertionError as e:
        assert "nobody (atom.models.no_such_family)" in str(e)
    else:
        raise AssertionError("a family without GPU tests passed the coverage check")


def test_every_family_runs_its_fp8_weights_in_the_gate():
    """Each family with FP8-stored presets has one of them in tests/gpu/test_fp8_cuda.py, so
    the gate runs that family's FP8 linears through the CUDA kernel."""
    from atom.models.common.fp8_linear import stored_fp8
    from atom.models.registry import all_presets, resolve_config

    text = (GPU_TESTS / "test_fp8_cuda.py").read_text()
    gated = {}
    for name in all_presets():
        cfg, _ = resolve_config(name)
        if stored_fp8(cfg):
            gated.setdefault(type(cfg).__name__, []).append(name)
    assert len(gated) == len(FAMILIES), gated
    missing = {f: names for f, names in gated.items() if not any(f'"{n}"' in text for n in names)}
    assert not missing, f"no FP8 preset of {missing} in tests/gpu/test_fp8_cuda.py"
