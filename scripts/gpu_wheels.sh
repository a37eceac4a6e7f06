#!/usr/bin/env bash
# Download the cp312 wheels the H200 image lacks (lmcache and what it imports at run time, and
# pydantic) into .whl/ (git-ignored), for `device` runs: see benchmarks/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(
  lmcache==0.5.6 msgspec nvtx pyzmq blake3 cachetools cryptography cffi pycparser
  importlib_metadata==8.7.1
  opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 opentelemetry-exporter-otlp==1.40.0
  opentelemetry-exporter-otlp-proto-common==1.40.0 opentelemetry-exporter-otlp-proto-grpc==1.40.0
  opentelemetry-exporter-otlp-proto-http==1.40.0 opentelemetry-proto==1.40.0
  opentelemetry-exporter-prometheus==0.61b0 opentelemetry-semantic-conventions==0.61b0
  googleapis-common-protos aiofile caio awscrt google-api-core google-auth google-cloud-bigtable
  google-cloud-core google-cloud-monitoring google-crc32c grpc-google-iam-v1 grpcio-status
  httpcore2 httpx2 proto-plus truststore
  pydantic pydantic-core annotated-types typing-inspection
)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 --platform any \
    -d .whl "$p" || echo "FAILED: $p" >&2
done
du -sh .whl  # wheels

# lmcache's CUDA sources (csrc/), to build lmcache.cuda_ops on the GPU machine against the torch
# found there: the wheel's build does not load with that torch, and the server then copies
# through torch ops (benchmarks/gpu/build_cuda_ops.py; benchmarks/gpu/README.md).
# The sdist is fetched by name through pip. `pip download` prepares an sdist's metadata, i.e.
# runs lmcache's setup.py: with build isolation that first installs its build requirements
# (torch: a multi-GB download), and without it setup.py imports torch and needs CUDA_HOME.
# NO_NATIVE_EXT=1 (lmcache's switch) skips the extensions, so the metadata needs only
# setuptools>=77 and setuptools_scm, installed into a throwaway venv for this one download.
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q --disable-pip-version-check \
  "setuptools>=77.0.3,<81" "setuptools_scm>=8" "packaging>=24.2" wheel
NO_NATIVE_EXT=1 timeout 300 "$TMP/venv/bin/python" -m pip download -q --disable-pip-version-check \
  --no-deps --no-binary :all: --no-build-isolation -d "$TMP/sdist" lmcache==0.5.6
rm -rf .whl/lmcache-csrc && mkdir -p .whl/lmcache-csrc
tar xzf "$TMP/sdist/lmcache-0.5.6.tar.gz" -C .whl/lmcache-csrc --strip-components=1 \
  lmcache-0.5.6/csrc/cuda lmcache-0.5.6/csrc/engine_kv_format.h \
  lmcache-0.5.6/csrc/kv_transfer_plan_types.h lmcache-0.5.6/csrc/kv_transfer_types.h
du -sh .whl/lmcache-csrc
