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


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools/import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cycles(root: Path) -> list[list[str]]:
    tool = _tool()
    return tool.cycles(tool.import_graph(root))


def test_no_import_cycles():
    assert _cycles(ATOM) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under tmp_path with the given files (relative path -> source)."""
    pkg = tmp_path / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return pkg


def test_the_tool_finds_a_cycle(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "a.py": "def f():\n    from pkg.b import g\n",
            "b.py": "from pkg import a\n",
            "c.py": "import pkg.a\n",
        },
    )
    assert _cycles(pkg) == [["pkg.a", "pkg.b"]]


def test_a_reintroduced_cycle_fails_the_check(tmp_path, capsys):
    # the shapes of the three cycles atom/models had: a model and its draft importing each other
    # lazily, a helper under TYPE_CHECKING, a reference through a third module; a cycle deep in
    # a subpackage counts like any other (no room is exempt)
    pkg = _package(
        tmp_path,
        {
            "models/fam/model.py": "def build():\n    from pkg.models.fam.draft import D\n",
            "models/fam/draft.py": "from pkg.models.fam.model import Base\n",
            "models/fam/hash.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.models.fam.tmap import T\n",
            "models/fam/tmap.py": "from .hash import H\n",
            "models/other/model.py": "from pkg.models.other import mtp\n",
            "models/other/mtp.py": "from pkg.models.other.reference import r\n",
            "models/other/reference.py": "from ..other.model import M\n",
            "fine.py": "from pkg.models.fam import hash\n",
        },
    )
    fam, other = "pkg.models.fam.", "pkg.models.other."
    assert _cycles(pkg) == [
        [fam + "draft", fam + "model"],
        [fam + "hash", fam + "tmap"],
        [other + "model", other + "mtp", other + "reference"],
    ]
    assert _tool().main(["import_cycles.py", str(pkg)]) == 1
    assert "3 import cycles" in capsys.readouterr().out
    (pkg / "models/fam/tmap.py").write_text("")
    (pkg / "models/fam/draft.py").write_text("")
    (pkg / "models/other/mtp.py").write_text("")
    assert _cycles(pkg) == []
    assert _tool().main(["import_cycles.py", str(pkg)]) == 0


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
