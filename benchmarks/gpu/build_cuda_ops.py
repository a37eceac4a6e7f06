"""Build ``lmcache.cuda_ops`` (lmcache 0.5.6's own CUDA sources) against the torch of this
machine, for the LMCache server's transfers.

The wheel's ``cuda_ops`` was built against another torch and does not load with the GPU
machine's; the server then logs "lmcache.cuda_ops compiled extension not found" and copies
through torch ops (one stream sync per kernel group, Python loops per chunk). This builds the
same sources as lmcache's setup (setup_extensions/build_profiles/cuda.py), for sm_90 only, and
installs the module over the wheel's in the target site directory.

    python3 benchmarks/gpu/build_cuda_ops.py --src .whl/lmcache-csrc/csrc --site /tmp/site

The build is kept in ``--build`` (git-ignored ``build/``): a second call on a warm machine only
re-installs it. Fetch the sources with ``scripts/gpu_wheels.sh``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

SOURCES = (  # lmcache 0.5.6, setup_extensions/build_profiles/cuda.py
    "pybind.cpp",
    "mem_kernels.cu",
    "mp_mem_kernels.cu",
    "phase_timing_recorder.cu",
    "blend_kernels.cu",
    "cal_cdf.cu",
    "ac_enc.cu",
    "ac_dec.cu",
    "pos_kernels.cu",
    "mem_alloc.cpp",
    "utils.cpp",
    "event_recorder.cpp",
    "completion_recorder.cpp",
)


def build(src: Path, out: Path, arch: str) -> Path:
    """Compile into ``out`` (ninja, incremental) and return the module's path."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpp_extension.load(
        name="cuda_ops",
        sources=[str(src / "cuda" / f) for f in SOURCES],
        extra_include_paths=[str(src), str(src / "cuda")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(out),
        verbose=False,
    )
    built = out / "cuda_ops.so"
    print(
        f"built {built} ({built.stat().st_size / 2**20:.1f} MiB) in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return built


def install(built: Path, site: Path) -> Path:
    """Put the module where ``import lmcache.cuda_ops`` finds it first."""
    target = site / "lmcache" / f"cuda_ops{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.parent.is_dir():
        raise SystemExit(f"{target.parent} does not exist: install the lmcache wheel first")
    shutil.copyfile(built, target)
    return target


def check(site: Path) -> None:
    """Import it the way the server will (a fresh interpreter) and bind it."""
    code = (
        "import torch, lmcache.cuda_ops as m; "
        "from lmcache.v1.platform.devices.cuda.device_ops import CudaDeviceOps; "
        "print('lmcache.cuda_ops loads:', m.__file__, len(dir(m)), 'symbols')"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--src", type=Path, default=Path(".whl/lmcache-csrc/csrc"))
    ap.add_argument("--build", type=Path, default=Path("build/lmcache_cuda_ops"))
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"))
    ap.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST (H200: 9.0)")
    args = ap.parse_args()
    built = args.build / "cuda_ops.so"
    if not built.exists():
        if not (args.src / "cuda" / "pybind.cpp").exists():
            raise SystemExit(f"no lmcache sources at {args.src}: run scripts/gpu_wheels.sh here")
        built = build(args.src, args.build, args.arch)
    print("installed", install(built, args.site), flush=True)
    check(args.site)


if __name__ == "__main__":
    main()
