"""docs/ARCHITECTURE.md section 4, kept honest: one tier hit against the real LMCache server,
its calls recorded under a profiler, on every thread of the engine.

Checked: the files of ``atom/engine`` and ``atom/tier`` whose functions the hit's calls visit
are exactly the doc's list (parsed from the doc), as many as the doc's text says, and at most 12
(issue 32's target; 7 of the engine and 5 of the tier now, 23 files before that issue); and
the engine state is written only by engine code: every call of a mutating method of the block
pool or the image store, and every attribute assignment on a ``Sequence``, comes from a frame of
an ``atom/engine`` file.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest

from atom import SamplingParams
from atom.engine.block_pool import BlockPool
from atom.engine.checkpoints import CheckpointStore
from atom.engine.sequence import Sequence

from .conftest import BLOCK
from .test_tier_faults import pump, settled
from .test_two_pass import GREEDY, prompts_of, tier

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/ARCHITECTURE.md"
ROOMS = ("atom/engine/", "atom/tier/")

# what writes engine state: every public mutator of the pool and of the image store
POOL_WRITES = {"allocate", "acquire", "release", "register", "forget"}
STORE_WRITES = {"create", "mark_ready", "pin", "unpin", "drop", "make_room", "get_ready"}
WRITES = {
    (BlockPool.__dict__[n].__code__.co_filename, BlockPool.__dict__[n].__code__.co_name)
    for n in POOL_WRITES
} | {
    (CheckpointStore.__dict__[n].__code__.co_filename, CheckpointStore.__dict__[n].__code__.co_name)
    for n in STORE_WRITES
}


def doc_files() -> set[str]:
    """The paths listed between the doc's ``trace-files`` markers."""
    text = DOC.read_text()
    m = re.search(r"<!-- trace-files: begin -->(.*?)<!-- trace-files: end -->", text, re.S)
    assert m, f"{DOC}: no trace-files list"
    return {line.split()[0] for line in m.group(1).splitlines() if line.startswith("atom/")}


def doc_counts() -> tuple[int, int, int]:
    """(files, of the engine, of the tier) as the doc's text states them."""
    words = r"(\d+) files,\s+(\d+)\s+of\s+the\s+engine\s+and\s+(\d+)\s+of\s+the\s+tier"
    m = re.search(words, DOC.read_text())
    assert m, f"{DOC}: no file count for the trace"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _rel(filename: str) -> str | None:
    try:
        return str(Path(filename).resolve().relative_to(ROOT))
    except ValueError:
        return None


class Recorder:
    """A profile function for every thread: the files called into, and who wrote what."""

    def __init__(self):
        self.on = False
        self.files: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []  # (thread, file, function), in call order
        self.writes: list[tuple[str, str]] = []  # (writer's file, what it wrote)
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        code = frame.f_code
        path = _rel(code.co_filename)
        if path is None or not path.startswith("atom/"):
            return
        caller = _rel(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        with self._lock:
            self.files.add(path)
            self.calls.append((threading.current_thread().name, path, code.co_qualname))
            if (code.co_filename, code.co_name) in WRITES:
                self.writes.append((caller or "?", f"{path}:{code.co_name}"))

    def seq_write(self, obj, name, value):
        if self.on:
            frame = sys._getframe(2)
            while frame.f_code.co_filename.startswith("<"):  # a dataclass's generated __init__
                frame = frame.f_back
            caller = _rel(frame.f_code.co_filename) or "?"
            with self._lock:
                self.writes.append((caller, f"Sequence.{name}"))
        object.__setattr__(obj, name, value)


@pytest.fixture()
def recorder(monkeypatch):
    rec = Recorder()
    threading.setprofile(rec)  # threads started from here on (the tier's) are recorded too

    def seq_setattr(obj, name, value):
        rec.seq_write(obj, name, value)

    monkeypatch.setattr(Sequence, "__setattr__", seq_setattr)
    yield rec
    rec.on = False
    threading.setprofile(None)
    sys.setprofile(None)


def test_a_tier_hit_visits_the_files_the_map_lists_and_only_the_engine_writes_its_state(
    lmcache_server, make_llm, recorder
):
    # three stored blocks; the tail [48, 53) and two decode tokens cross no boundary: no store
    warm, prompt = prompts_of([2 * BLOCK + 3, 3 * BLOCK + 5], seed=3217)
    first = make_llm(**tier(lmcache_server))
    first.generate([prompt], GREEDY)
    pump(first, lambda: settled(first), "the first engine's stores")

    second = make_llm(**tier(lmcache_server))
    second.generate([warm], GREEDY)  # connects, maps the server's L1; a miss
    pump(second, lambda: settled(second), "the warm-up's stores")
    conn = second.engine.scheduler.connector
    copied = conn.tier_metrics.local_loads.get(outcome="copied")

    recorder.on = True
    sys.setprofile(recorder)
    out = second.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    for _ in range(200):  # idle steps fold the last outcomes and end the session
        if settled(second) and not conn._requests:
            break
        second.engine.run_once()
    sys.setprofile(None)
    recorder.on = False

    assert out.tier_hit_tokens == 3 * BLOCK and out.computed_prompt_tokens == 5
    assert conn.tier_metrics.local_loads.get(outcome="copied") == copied + 1  # engine-driven
    visited = {f for f in recorder.files if f.startswith(ROOMS)}
    listed = doc_files()
    assert visited == listed, (
        f"visited, not in the doc: {sorted(visited - listed)}; "
        f"in the doc, not visited: {sorted(listed - visited)}"
    )
    engine = {f for f in visited if f.startswith("atom/engine/")}
    assert doc_counts() == (len(visited), len(engine), len(visited - engine))
    assert len(visited) <= 12, sorted(visited)  # issue 32's target
    ours = [(f, fn) for _, f, fn in recorder.calls if f.startswith(ROOMS)]
    print(f"trace: {len(ours)} calls, {len(set(ours))} functions, {len(visited)} files")
    writers = {w for w, _ in recorder.writes}
    assert recorder.writes and all(w.startswith("atom/engine/") for w in writers), sorted(
        {(w, what) for w, what in recorder.writes if not w.startswith("atom/engine/")}
    )


def test_the_recorder_sees_a_write_from_outside_the_engine(recorder):
    pool = BlockPool(4)
    recorder.on = True
    sys.setprofile(recorder)
    blocks = pool.allocate(1)
    sys.setprofile(None)
    recorder.on = False
    assert blocks and recorder.writes == [
        ("tests/offload/test_trace_map.py", "atom/engine/block_pool.py:allocate")
    ]
