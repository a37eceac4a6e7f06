"""The package map of docs/ARCHITECTURE.md, checked from the import statements.

No import cycle among atom's modules (``tools/import_cycles.py``); each room imports only the
rooms it may: the engine no model, tier or ranks; the ranks no tier; only the tier lmcache.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATOM = ROOT / "atom"

# cycles inside atom/models, which another change owns (each is a model and its draft or
# reference importing each other); none may be added, and none anywhere else
_V4, _V41 = "atom.models.deepseek_v4.", "atom.models.deepseek_v41."
KNOWN_MODEL_CYCLES = [
    {_V4 + "model", _V4 + "mtp", _V4 + "reference"},
    {_V41 + "draft", _V41 + "dspark", _V41 + "model"},
    {_V41 + "ngram_hash", _V41 + "token_map"},
]


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools/import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles():
    tool = _tool()
    found = [set(c) for c in tool.cycles(tool.import_graph(ATOM))]
    outside = [c for c in found if not all(m.startswith("atom.models.") for m in c)]
    assert outside == []
    assert all(c in KNOWN_MODEL_CYCLES for c in found), found


def test_the_tool_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from pkg import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    tool = _tool()
    assert tool.cycles(tool.import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def _imports(room: str) -> dict[str, set[str]]:
    """file (relative to atom/) -> the top-level-or-atom modules it imports."""
    out = {}
    for path in sorted((ATOM / room).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[str(path.relative_to(ATOM))] = names
    return out


def _offenders(room: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for f, names in _imports(room).items():
        hit = sorted(n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden))
        if hit:
            bad[f] = hit
    return bad


def test_rooms_import_only_what_they_may():
    assert _offenders("engine", ("atom.models", "atom.tier", "atom.distributed", "lmcache")) == {}
    assert _offenders("distributed", ("atom.tier", "lmcache")) == {}
    assert _offenders("serve", ("lmcache",)) == {}
    assert _offenders("models", ("atom.tier", "lmcache")) == {}


def test_no_basename_shared_by_the_tier_and_the_engine():
    tier = {p.name for p in (ATOM / "tier").rglob("*.py")} - {"__init__.py"}
    engine = {p.name for p in (ATOM / "engine").rglob("*.py")} - {"__init__.py"}
    assert tier & engine == set()
