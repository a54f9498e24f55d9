#!/usr/bin/env bash
# One entry point for a fresh machine: sets up (or refreshes) .venv, then runs a job.
#   ./run.sh demo          the main job: `specsampler demo`
#   ./run.sh test [ARGS]   the test suite (pytest ARGS), in one process per core (SPECSAMPLER_TEST_WORKERS
#                          or `-n N` in ARGS sets how many; 0: this process); SPECSAMPLER_FULL_MC=1 for
#                          full-size Monte Carlo
#   ./run.sh CMD [ARGS]    any other `specsampler` sub-command (check, bench, ...)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi

stamp_of() { cat pyproject.toml run.sh | sha256sum | cut -d' ' -f1; }

if [ ! -x .venv/bin/python ]; then
  echo "[run.sh] creating .venv with $PY" >&2
  "$PY" -m venv .venv
fi
if [ "$(cat .venv/.specsampler-stamp 2>/dev/null || true)" != "$(stamp_of)" ]; then
  echo "[run.sh] installing dependencies into .venv" >&2
  log=.venv/install.log
  # torch first, pinned: on the project's machines this is the local CPU wheel.
  if ! { .venv/bin/python -m pip install -q "torch==2.13.0" &&
         .venv/bin/python -m pip install -q -e ".[dev,triton,hf]"; } >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2
    echo "[run.sh] dependency installation failed (log: $log)" >&2
    exit 1
  fi
  stamp_of > .venv/.specsampler-stamp
fi

job=${1:-demo}
[ $# -gt 0 ] && shift
case "$job" in
  test) exec .venv/bin/python -m pytest -n "${SPECSAMPLER_TEST_WORKERS:-auto}" "$@" ;;
  *) exec .venv/bin/specsampler "$job" "$@" ;;
esac
