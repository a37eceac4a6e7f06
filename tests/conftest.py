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


@pytest.fixture(autouse=True)
def _default_arithmetic():
    """Each test starts in the default arithmetic: an engine built with ``batch_invariant``
    turns the process's mode on (``atom.kernels.invariant.configure``), and model code run
    directly by a later test must not inherit it."""
    from atom.kernels import invariant

    invariant.configure(False)
    yield
    invariant.configure(False)


@pytest.fixture(scope="session", autouse=True)
def serve_logs(tmp_path_factory):
    """Servers a test starts (``tests.serve.conftest.ServeProcess``) log under this session's
    pytest temporary directory, which pytest prunes, not under /tmp, where nothing would."""
    from tests.serve.conftest import ServeProcess

    ServeProcess.log_root = tmp_path_factory.mktemp("serve-logs")
    yield
    ServeProcess.log_root = None
