#!/usr/bin/env bash
# One device-tool call of a GPU session, run from the repository root on the GPU machine (its image
# has torch, triton, pytest, hypothesis, scipy and transformers; nothing is installed). Writes logs and
# results under $OUT (default ./gpu-out):
#
#   bash benchmarks/gpu_session.sh check   # every kernel test and the GPU-only tests on the GPU
#   bash benchmarks/gpu_session.sh exact   # the exactness Monte Carlo against the kernels, full size
#   bash benchmarks/gpu_session.sh bench   # benchmarks/gpu.py -> $OUT/gpu-<device>.json (+ FlashInfer
#                                          #   baselines when .flashinfer/ is carried: flashinfer_carry.sh;
#                                          #   $GPU_ARGS go to gpu.py, as for tune)
#   bash benchmarks/gpu_session.sh tune    # tuning: every benchmark shape, kernels only, under each setting
#                                          #   of $SETTINGS (';'-separated lists of environment assignments;
#                                          #   default: pipelining depth SPECSAMPLER_PIPELINE_STAGES 1 and 4 with
#                                          #   one program per SM, SPECSAMPLER_PROGRAMS_PER_SM=1, then 4 and 6 with
#                                          #   the default two), side by side -> $OUT/tune-<i>.json
#                                          #   ($GPU_ARGS go to gpu.py: "--quick" is a smoke test on any device)
#
# Compiling is the slow part of a first run: each kernel variant (method, flags, dtypes, tuning, vocabulary
# size) takes seconds to a minute or more on one core (tests/helpers/compile_kernels.py measured 30-80 s per tree or
# chain kernel from logits on this project's CPU machine), and the kernel tests launch ~360 of them. So the
# tests run in 16 parallel processes (the machine has 16 cores), the benchmark's parts are compiled in
# parallel before it is timed, and the Triton cache is kept in the git-ignored .triton-cache/, which a warm
# machine keeps for the next call (start it within the machine's 30 s of warmth): a `check` cut off by the
# 10-minute limit goes on from its cache when run again.
set -uo pipefail
phase=${1:?check, exact, bench or tune}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

# run "name command..." jobs in parallel, each logging to /tmp/<name>.log; then their logs, in order, to
# the file $1 (one file: the device tool returns few); fails if any job failed
parallel() {
  local log=$1 status=0 pid names=() pids=()
  shift
  while [ $# -gt 0 ]; do
    local name=$1 cmd=$2
    shift 2
    bash -c "$cmd" >"/tmp/$name.log" 2>&1 &
    names+=("$name"); pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || status=1
    { echo "=== ${names[$i]}"; cat "/tmp/${names[$i]}.log"; } >>"$log"
  done
  return $status
}

# FlashInfer from the carried pack (benchmarks/flashinfer_carry.sh), unpacked to /tmp/fi, its JIT cache under
# .flashinfer/cache (kept on a warm machine). Its sampling kernels are compiled on first use (nvcc, ninja;
# MAX_JOBS in parallel); they include <curand.h> and link -lcudart -lcuda from $CUDA_HOME/lib64(/stubs).
# A CUDA 13 toolkit assembled from wheels, as on this project's CPU machines, had neither curand.h nor
# stubs, and FlashInfer takes CUDA_HOME to be the folder above the one holding nvcc (a wrapper script there).
# So CUDA_HOME is where nvcc says it lives, curand.h comes from the nvidia-curand wheel where the toolkit
# lacks it (CPATH, read by nvcc's host compiler), and libcudart / libcuda are linked against the files the
# process has loaded after a CUDA call (LIBRARY_PATH, read by the linker).
export FI_BUILD="import time; t = time.time(); from flashinfer.jit.sampling import gen_sampling_module as g; \
g().build_and_load(); print(f'FlashInfer sampling module built and loaded in {time.time() - t:.0f} s')"
flashinfer_setup() {
  mkdir -p /tmp/fi .flashinfer/cache /tmp/fi-lib
  tar xzf .flashinfer/flashinfer.tgz -C /tmp/fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/fi .flashinfer/apache_tvm_ffi-*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/fi" FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer/cache MAX_JOBS=${MAX_JOBS:-16}
  if [ -z "${CUDA_HOME:-}" ]; then
    CUDA_HOME=$(realpath "$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')")
    export CUDA_HOME
  fi
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
  { echo "CUDA_HOME=$CUDA_HOME CPATH=${CPATH:-}"; ls -l /tmp/fi-lib | tail -n +2
    python3 -c "import flashinfer.sampling" 2>&1 | tail -3; } | tee "$OUT/flashinfer.log"
}

# the chain shapes' compile passes, one per vocabulary (about five variants each); --quick has one chain shape
chain_parts=("chain --chain-vocab 128256" "chain --chain-vocab 200064")
[[ "${GPU_ARGS:-}" == *--quick* ]] && chain_parts=(chain)

case "$phase" in
  check)
    # the kernel tests launch ~360 distinct kernel specialisations (shapes, dtypes, flags, tuning; counted
    # in the interpreter), each compiled once: spread the tests over 16 processes, a few at a time
    files="tests/kernels/test_gpu.py tests/kernels/test_kernels_sampling.py tests/kernels/test_kernels_chain.py tests/kernels/test_kernels_chain_logits.py
           tests/kernels/test_kernels_tree.py tests/kernels/test_kernels_tree_logits.py tests/kernels/test_kernels_mlc.py tests/kernels/test_backend.py"
    python3 -m pytest -q --collect-only -p no:cacheprovider $files | grep "::" >/tmp/check-nodes.txt
    rm -f /tmp/check-part-*.log
    xargs -a /tmp/check-nodes.txt -d '\n' -P 16 -n 4 \
      sh -c 'python3 -m pytest -q -p no:cacheprovider "$@" >"/tmp/check-part-$$.log" 2>&1' sh
    cat /tmp/check-part-*.log >"$OUT/check.log"
    echo "$(wc -l </tmp/check-nodes.txt) tests:"
    grep -hE "passed|failed|error" /tmp/check-part-*.log | sort | uniq -c
    ;;
  exact)
    SPECSAMPLER_FULL_MC=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernels_exactness.py \
      tests/mlc/test_mlc_sampler.py tests/mlc/test_mlc_verify.py 2>&1 | tee "$OUT/exact.log"
    ;;
  bench)
    fi_job=()
    if [ -f .flashinfer/flashinfer.tgz ]; then
      flashinfer_setup
      fi_job=(flashinfer 'python3 -c "$FI_BUILD"')
    fi
    # compile every variant in parallel with one untimed pass per part, and FlashInfer's sampling module
    jobs=()
    for part in "${chain_parts[@]}" sampling tree; do
      jobs+=("${part// /-}" "python3 benchmarks/gpu.py --only $part --reps 1 --inner 1 ${GPU_ARGS:-}")
    done
    parallel "$OUT/bench-compile.log" "${fi_job[@]}" "${jobs[@]}"
    tail -n 2 "$OUT/bench-compile.log"
    name=$(python3 -c "import torch
print(torch.cuda.get_device_name().lower().replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
    python3 benchmarks/gpu.py ${GPU_ARGS:-} --out "$OUT/gpu-$name.json" 2>&1 | tee "$OUT/bench.log"
    ;;
  tune)
    IFS=';' read -ra settings <<<"${SETTINGS:-SPECSAMPLER_PIPELINE_STAGES=1 SPECSAMPLER_PROGRAMS_PER_SM=1;\
SPECSAMPLER_PIPELINE_STAGES=4 SPECSAMPLER_PROGRAMS_PER_SM=1;SPECSAMPLER_PIPELINE_STAGES=4;SPECSAMPLER_PIPELINE_STAGES=6}"
    jobs=()
    for i in "${!settings[@]}"; do
      for part in "${chain_parts[@]}" sampling tree; do
        jobs+=("compile-$i-${part// /-}" "env ${settings[$i]} python3 benchmarks/gpu.py --only $part --reps 1 --inner 1 --no-baselines ${GPU_ARGS:-}")
      done
    done
    parallel "$OUT/tune-compile.log" "${jobs[@]}"
    tail -n 2 "$OUT/tune-compile.log"
    files=()
    for i in "${!settings[@]}"; do
      echo "=== setting $i: ${settings[$i]}" | tee -a "$OUT/tune.log"
      env ${settings[$i]} python3 benchmarks/gpu.py --no-baselines ${GPU_ARGS:-} --out "$OUT/tune-$i.json" \
        >>"$OUT/tune.log" 2>&1
      files+=("$OUT/tune-$i.json")
    done
    python3 benchmarks/gpu.py --compare "${files[@]}" | tee "$OUT/tune-compare.txt"
    ;;
  *) echo "unknown phase: $phase" >&2; exit 2 ;;
esac
