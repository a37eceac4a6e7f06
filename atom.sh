#!/usr/bin/env bash
# One entry point for a newcomer:
#   ./atom.sh serve [flags]   set up (first run) and serve v41-mini with the LMCache tier
#   ./atom.sh test  [args]    set up (first run) and run the test suite (two workers)
set -euo pipefail
cd "$(dirname "$0")"
export LMCACHE_TRACK_USAGE=false
PY=${PYTHON:-python3}

setup() {
  local stamp=.venv/.atom-setup
  local want
  want=$(cat setup.py | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  echo "[atom] setting up .venv (first run: a few minutes)" >&2
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # CPU torch first: lmcache asks for plain torch, which would otherwise pull a CUDA build.
  .venv/bin/pip install -q "torch==2.13.*"
  .venv/bin/pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
}

cmd=${1:-serve}
shift || true
case "$cmd" in
  setup) setup ;;
  serve) setup; exec .venv/bin/python -m atom.serve --model v41-mini --offload lmcache_mp "$@" ;;
  # two worker processes, each taking whole files (module fixtures run once); most tests wait on
  # servers and rank processes, so two share two cores well. ATOM_TEST_WORKERS=0: in-process
  test) setup; exec .venv/bin/python -m pytest -q -n "${ATOM_TEST_WORKERS:-2}" --dist loadfile "$@" ;;
  *) echo "usage: ./atom.sh serve|test|setup [args]" >&2; exit 2 ;;
esac
