import os

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


@pytest.fixture
def fake_engine_graphs(monkeypatch):
    """Engines built in the test replay fake CUDA graphs (decode; verify and draft with
    drafts) through ``EagerBackend``: everything but the CUDA graph itself runs on CPU. The
    list holds every runtime made, in order."""
    from atom import builder
    from atom.models.deepseek_v41.decode_graphs import EagerBackend

    made = []
    real = builder.load_runtime

    def load(*a, **k):
        rt = real(*a, **k)
        rt.enable_decode_graphs(8, backend=EagerBackend())
        made.append(rt)
        return rt

    monkeypatch.setattr(builder, "load_runtime", load)
    return made
