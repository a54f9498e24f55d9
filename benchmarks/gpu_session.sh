#!/usr/bin/env bash
# A GPU session in one or two device-tool calls, run from the repository root on the GPU machine (its image
# has torch, triton, pytest, pytest-xdist, pytest-timeout, hypothesis, scipy and transformers; nothing is
# installed). Each phase has its own time limit, so a call of at most 8 minutes always reaches its end, and
# names what it could not finish. Logs and results go under $OUT (default ./gpu-out), at most 8 files:
#
#   bash benchmarks/gpu_session.sh check   # ~7 min: compile (specsampler warmup, 16 processes; then a second
#                                          #   process from the cache), the GPU tests (-v, a per-test timeout:
#                                          #   every outcome named), the demo cold and warm, the latency and
#                                          #   sampling benchmarks (no baselines but PyTorch's)
#   bash benchmarks/gpu_session.sh bench   # ~5 min: the tests named in $TESTS, if any (a rerun after fixes), then
#                                          #   FlashInfer built from the carried pack
#                                          #   (benchmarks/flashinfer_carry.sh), then benchmarks/gpu.py with its
#                                          #   baselines, short parts first -> $OUT/gpu.json
#
# Triton's cache is the git-ignored .triton-cache/, which a warm machine keeps for the next call (start it within
# the machine's 30 s of warmth): `bench` then compiles nothing `check` compiled.
set -uo pipefail
phase=${1:?check or bench}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
log="$OUT/session.log"
say() { echo "$*" | tee -a "$log"; }
# run a phase under a time limit: limit_s name command...; its output to $OUT/<name>.log (appended)
step() {
  local limit=$1 name=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  say "[$name] exit $rc after $(( $(date +%s) - start )) s (limit $limit s)$([ $rc = 124 ] && echo ': CUT OFF')"
  return $rc
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'SMs',
torch.cuda.get_device_properties(0).multi_processor_count)"; nproc; } | tee -a "$log"

case "$phase" in
  check)
    # 1. compile: every specialisation of V = 128256 for bf16 and float32 logits, cold, in 16 processes; then a
    # new process warms up from the cache (the serving start-up cost)
    step 240 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype bfloat16 --workers 16
    step 240 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype float32 --workers 16
    step 60 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype bfloat16 --workers 1
    grep -h "launches warmed up" "$OUT/warmup.log" | tee -a "$log"
    # 2. the GPU tests, each named with its outcome (-v under xdist prints one line per test)
    step 230 tests python3 -m pytest -v -n 8 --timeout 120 -p no:cacheprovider -m gpu tests
    grep -hE "^(FAILED|ERROR)|(passed|failed|error).* in " "$OUT/tests.log" | tee -a "$log"
    # 3. the demo on the GPU: cold (its kernels for V = 256 compiled), then warm (from the cache)
    step 150 demo python3 -m specsampler.cli demo --device cuda
    step 90 demo python3 -m specsampler.cli demo --device cuda
    grep -hE "^kernels:|^Total|tokens/s" "$OUT/demo.log" | tee -a "$log"
    # 4. latency of every op at B = 1, and sampling, against one read of the logits
    step 100 bench python3 benchmarks/gpu.py --only latency --only sampling --reps 10 --out "$OUT/gpu-check.json"
    tail -n 30 "$OUT/bench.log"
    ;;
  bench)
    # tests named in $TESTS first (a rerun of what check found failing, after the fixes)
    if [ -n "${TESTS:-}" ]; then
      # shellcheck disable=SC2086
      step 150 tests python3 -m pytest -v -n 8 --timeout 120 -p no:cacheprovider $TESTS
      grep -hE "^(FAILED|ERROR)|(passed|failed|error).* in " "$OUT/tests.log" | tee -a "$log"
    fi
    if [ -f .flashinfer/flashinfer.tgz ]; then
      mkdir -p /tmp/fi .flashinfer/cache /tmp/fi-lib
      tar xzf .flashinfer/flashinfer.tgz -C /tmp/fi
      python3 -m pip install -q --no-index --no-deps --target /tmp/fi .flashinfer/apache_tvm_ffi-*.whl
      export PYTHONPATH="$PYTHONPATH:/tmp/fi" FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer/cache MAX_JOBS=16
      # FlashInfer takes CUDA_HOME to be the folder above nvcc's; curand.h from the nvidia-curand wheel where the
      # toolkit lacks it; libcudart / libcuda linked against the files the process loaded after a CUDA call
      CUDA_HOME=$(realpath "$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')")
      export CUDA_HOME
      if [ ! -f "$CUDA_HOME/include/curand.h" ]; then
        CPATH=$(python3 -c "import glob, nvidia; print(':'.join(sorted({p[:-len('/curand.h')] for d in nvidia.__path__
for p in glob.glob(d + '/*/include/curand.h')})))")${CPATH:+:$CPATH}
        export CPATH
      fi
      python3 - <<'PY'
import os, torch
torch.zeros(1, device="cuda")  # loads the driver and runtime libraries
loaded = [line.split()[-1] for line in open("/proc/self/maps") if "/lib" in line]
home = os.environ["CUDA_HOME"]
for lib in ("libcudart.so", "libcuda.so"):
    if any(os.path.exists(f"{home}/{d}/{lib}") for d in ("lib64", "lib64/stubs")):
        continue
    path = next((p for p in loaded if os.path.basename(p).startswith(lib)), None)
    if path and not os.path.lexists(f"/tmp/fi-lib/{lib}"):
        os.symlink(path, f"/tmp/fi-lib/{lib}")
PY
      export LIBRARY_PATH="/tmp/fi-lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
      # the sampling and top-k modules, compiled on first use: build both now, timed
      step 200 flashinfer python3 -c "import time, torch, flashinfer.sampling as s; t = time.time()
x = torch.randn(2, 1000, device='cuda'); s.top_k_top_p_sampling_from_logits(x, 5, 0.9); s.softmax(x)
print(f'FlashInfer sampling and top-k modules built and loaded in {time.time() - t:.0f} s')"
      tail -n 3 "$OUT/flashinfer.log" | tee -a "$log"
    fi
    step 280 bench python3 benchmarks/gpu.py --only latency --only sampling --only chain --only tree --reps 10 \
      --chain-vocab 128256 --out "$OUT/gpu.json"
    tail -n 60 "$OUT/bench.log"
    ;;
  *) echo "unknown phase: $phase" >&2; exit 2 ;;
esac
