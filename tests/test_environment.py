"""README's table of environment variables, kept honest: every variable a file under atom/
reads (``os.environ`` / ``os.getenv``) is a row naming that file or its directory, and every row
names a variable the code still reads. What each one is (a debugging override of a config
field, a secret, networking) is the table's to say; what changes computation is a config field.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NAME = re.compile(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+")


def documented() -> dict[str, str]:
    """variable -> the file or directory its row says reads it."""
    text = README.read_text()
    start = text.index("**Environment variables.**")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[1] in ("read in", "---"):
            continue
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]):
            rows[name] = cells[1]
    return rows


def read_by_code() -> dict[str, set[str]]:
    """variable -> the files under atom/ that name it and read the environment."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "atom").rglob("*.py")):
        tree = ast.parse(path.read_text())
        reads = any(
            isinstance(n, ast.Attribute)
            and n.attr in ("environ", "getenv")
            and isinstance(n.value, ast.Name)
            and n.value.id == "os"
            for n in ast.walk(tree)
        )
        if not reads:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                if NAME.fullmatch(n.value):
                    found.setdefault(n.value, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_environment_variable_atom_reads_is_in_the_readme_table():
    rows, code = documented(), read_by_code()
    assert "ATOM_GROUPED_MM" in code and "ATOM_VERIFY_CURSORS" in code  # the scan sees them
    missing = sorted(set(code) - set(rows))
    assert missing == [], f"read under atom/ but not in README's table: {missing}"
    stale = sorted(set(rows) - set(code))
    assert stale == [], f"in README's table but read nowhere under atom/: {stale}"
    for name, files in code.items():
        assert all(f.startswith(rows[name]) for f in files), (name, files, rows[name])
