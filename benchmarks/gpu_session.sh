#!/usr/bin/env bash
# A GPU session in one or two device-tool calls, run from the repository root on the GPU machine (its image
# has torch, triton, pytest, pytest-xdist, pytest-timeout, hypothesis, scipy and transformers; nothing is
# installed). Phases run in the order given, each under its own time limit, all within the call's budget
# ($BUDGET_S, default 470 s: under 8 minutes; give the device tool's timeout_s at least 30 s more): a step's
# limit is cut to what is left of the budget and a step with under 20 s left is skipped, named SKIPPED, so a call
# always reaches its end and names what it could not finish. Logs and results go under $OUT (default ./gpu-out),
# at most 8 files (the device tool returns no more).
#
#   bash benchmarks/gpu_session.sh check        # ~6.5 min: warmup tests demo latency
#   bash benchmarks/gpu_session.sh measure      # <= 8 min: flashinfer latency bench tests (FlashInfer built
#                                               #   while the latency phase compiles and runs)
#   bash benchmarks/gpu_session.sh warmup       # compile every specialisation of V = 128256 (bf16 and float32
#                                               #   logits) in 16 processes; a second process from the cache
#   TESTS="node ids" bash ... tests             # the GPU tests (-m gpu), or those named; -v, a per-test timeout
#   bash benchmarks/gpu_session.sh demo         # `specsampler demo --device cuda`, cold then warm
#   bash benchmarks/gpu_session.sh latency      # every op at B = 1, its kernels listed (benchmarks/gpu.py)
#   bash benchmarks/gpu_session.sh flashinfer   # FlashInfer from the carried pack (benchmarks/flashinfer_carry.sh;
#                                               #   carry .flashinfer): its sampling and top-k modules built in
#                                               #   the background while the next phases run (bench takes the
#                                               #   top-k module's baselines only if it is built by then)
#   bash benchmarks/gpu_session.sh flashinfer bench   # chains, sampling and trees with FlashInfer's baselines
#   bash benchmarks/gpu_session.sh exact        # the exactness Monte Carlo against the kernels, full size
#   bash benchmarks/gpu_session.sh parallel     # the vocab-parallel ops, both strategies, NCCL at world size 1
#                                               #   (benchmarks/parallel.py; $PARALLEL_ARGS replace its arguments)
#   SETTINGS="A=1 B=2;A=3" bash ... tune        # gpu.py's shapes under each setting of the kernels' environment
#                                               #   variables, side by side
# $GPU_ARGS go to benchmarks/gpu.py in latency, bench and tune (bench's default: --chain-vocab 128256); e.g.
# GPU_ARGS="--quick --device cpu" runs the phases on the CPU, as tests/cli/test_bench.py does.
#
# Triton's cache is the git-ignored .triton-cache/, which a warm machine keeps for the next call (start it within
# the machine's 30 s of warmth): a later phase then compiles nothing an earlier one compiled.
set -uo pipefail
[ $# -gt 0 ] || { echo "phases: warmup tests demo latency flashinfer bench exact tune parallel (check = the first four)" >&2
                  exit 2; }
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# the end of the call's budget, shared with the nested runs of check and measure
export SESSION_END=${SESSION_END:-$(( $(date +%s) + ${BUDGET_S:-470} ))}
# FlashInfer's build markers, outside $OUT (whose files the device tool returns, at most 8)
FI_STATE=${TMPDIR:-/tmp}/specsampler-fi-state
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
log="$OUT/session.log"
say() { echo "$*" | tee -a "$log"; }
# run a phase under a time limit: limit_s name command...; its output to $OUT/<name>.log (appended). The limit is
# cut to the call's budget less 15 s (the kill's grace and the lines after the step); under 20 s left: skipped
step() {
  local limit=$1 name=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( SESSION_END - start - 15 ))
  if [ "$left" -lt 20 ]; then
    say "[$name] SKIPPED: ${left} s left of the call's budget (BUDGET_S): $*"
    return 124
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  say "[$name] exit $rc after $(( $(date +%s) - start )) s (limit $limit s)$(
    case $rc in 124|137) echo ': CUT OFF';; esac)"
  return $rc
}
# pytest's options for naming each test with its outcome: -v, and a per-test timeout (pytest-timeout, on the GPU
# image) that ends a test hung in C code too (thread: the worker exits, xdist names the test and starts another);
# -n (pytest-xdist) where installed
pytest_opts() {  # per-test timeout in s
  python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout $1 --timeout-method=thread"
  python3 -c "import xdist" 2>/dev/null && echo "-n 8"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'SMs',
torch.cuda.get_device_properties(0).multi_processor_count)"; nproc; } | tee -a "$log"

flashinfer_setup() {  # FlashInfer from the carried pack (benchmarks/flashinfer_carry.sh), its modules built
  [ -f .flashinfer/flashinfer.tgz ] || { say "[flashinfer] no pack carried: no FlashInfer baselines"; return 0; }
  mkdir -p /tmp/fi .flashinfer/cache /tmp/fi-lib
  tar xzf .flashinfer/flashinfer.tgz -C /tmp/fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/fi .flashinfer/apache_tvm_ffi-*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/fi" FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer/cache MAX_JOBS=8
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
  # the sampling and top-k modules, compiled on first use: built now, in the background (nvcc, 8 jobs), one after
  # the other, while the phases after this one run; `bench` waits for the sampling module (its sequential
  # baselines) and takes the top-k one only if it is built by then. top_k_top_p_sampling_from_logits takes the
  # top-k module (a radix top-k, then top-p over the k) only from V = 65536 on. Measured 2026-11-27: the sampling
  # module about 100 s on both machines; the top-k module over 300 s on the H100 machine (cut off there)
  mkdir -p "$FI_STATE"
  rm -f "$FI_STATE/sampling" "$FI_STATE/topk"
  ( step 240 flashinfer python3 -c "import time, torch, flashinfer.sampling as s; t = time.time()
x = torch.randn(2, 4096, device='cuda'); s.top_p_renorm_probs(s.top_k_renorm_probs(s.softmax(x), 5), 0.9)
print(f'FlashInfer sampling module built and loaded in {time.time() - t:.0f} s')" && touch "$FI_STATE/sampling"
    step "${FI_TOPK_LIMIT:-900}" flashinfer python3 -c "import time, torch, flashinfer.sampling as s
t = time.time(); s.top_k_top_p_sampling_from_logits(torch.randn(2, 65536, device='cuda'), 5, 0.9)
print(f'FlashInfer top-k module built and loaded in {time.time() - t:.0f} s')" && touch "$FI_STATE/topk" ) &
  fi_build=$!
}

for phase in "$@"; do
  case "$phase" in
    warmup)  # every specialisation of V = 128256, bf16 and float32 logits, cold in 16 processes; then a new
             # process warms up from the cache (the serving start-up cost)
      step 240 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype bfloat16 --workers 16
      step 240 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype float32 --workers 16
      step 60 warmup python3 -m specsampler.cli warmup --vocab-size 128256 --dtype bfloat16
      grep -h "launches warmed up" "$OUT/warmup.log" | tee -a "$log" ;;
    tests)  # the GPU tests (or those named in $TESTS), each named with its outcome (-v: a line per test)
      # shellcheck disable=SC2046,SC2086
      step "${TESTS_LIMIT:-230}" tests python3 -m pytest -v $(pytest_opts 120) -p no:cacheprovider ${TESTS:--m gpu tests}
      grep -hE "^(FAILED|ERROR)|(passed|failed|error).* in " "$OUT/tests.log" | tee -a "$log" ;;
    demo)  # the demo on the GPU: cold (its kernels for V = 256 compiled), then warm (from the cache)
      step 150 demo python3 -m specsampler.cli demo --device cuda
      step 90 demo python3 -m specsampler.cli demo --device cuda
      grep -hE "^kernels:|^Total" "$OUT/demo.log" | tee -a "$log" ;;
    latency)  # every op at B = 1 against one read of the logits, and the kernels one call launches
      # shellcheck disable=SC2086
      step "${LATENCY_LIMIT:-100}" bench python3 benchmarks/gpu.py --only latency --profile --reps 10 \
        ${GPU_ARGS:-} --out "$OUT/gpu-latency.json"
      grep -vE "^ +[0-9.]+ us  " "$OUT/bench.log" | tail -n 30 ;;
    flashinfer) flashinfer_setup ;;
    bench)  # chains (V = 128256), sampling and trees, with FlashInfer's baselines when flashinfer ran before
      fi_args=()
      if [ -n "${fi_build:-}" ]; then
        while [ ! -f "$FI_STATE/sampling" ] && kill -0 "$fi_build" 2>/dev/null; do sleep 2; done
        [ -f "$FI_STATE/topk" ] || fi_args=(--no-flashinfer-topk)
        say "[bench] FlashInfer modules built: $(find "$FI_STATE" -type f -printf '%f ' 2>/dev/null)"
      fi
      # shellcheck disable=SC2086
      step "${BENCH_LIMIT:-280}" bench python3 benchmarks/gpu.py --only chain --only sampling --only tree --reps 10 \
        ${GPU_ARGS:---chain-vocab 128256} "${fi_args[@]}" --out "$OUT/gpu-bench.json"
      tail -n 40 "$OUT/bench.log" ;;
    exact)  # the exactness Monte Carlo against the kernels at full size
      # shellcheck disable=SC2046
      SPECSAMPLER_FULL_MC=1 step 400 exact python3 -m pytest -v $(pytest_opts 300) -p no:cacheprovider -m gpu \
        tests/kernels/test_kernels_exactness.py tests/mlc/test_mlc_sampler.py tests/mlc/test_mlc_verify.py
      grep -hE "^(FAILED|ERROR)|(passed|failed|error).* in " "$OUT/exact.log" | tee -a "$log" ;;
    tune)  # the benchmark shapes, kernels only, under each setting of $SETTINGS (';'-separated environment
           # assignments; default: pipelining depth 1 and 4 with one program per SM, then 4 and 6 with two)
      IFS=';' read -ra settings <<<"${SETTINGS:-SPECSAMPLER_PIPELINE_STAGES=1 SPECSAMPLER_PROGRAMS_PER_SM=1;\
SPECSAMPLER_PIPELINE_STAGES=4 SPECSAMPLER_PROGRAMS_PER_SM=1;SPECSAMPLER_PIPELINE_STAGES=4;SPECSAMPLER_PIPELINE_STAGES=6}"
      files=()
      for i in "${!settings[@]}"; do
        # shellcheck disable=SC2086
        step 240 tune env ${settings[$i]} python3 benchmarks/gpu.py --no-baselines --reps 10 ${GPU_ARGS:-} \
          --out "$OUT/tune-$i.json"
        [ -s "$OUT/tune-$i.json" ] && files+=("$OUT/tune-$i.json")  # a run cut off keeps what it measured
      done
      if [ ${#files[@]} -gt 0 ]; then
        python3 benchmarks/gpu.py --compare "${files[@]}" | tee "$OUT/tune-compare.txt" | tee -a "$log"
      fi ;;
    parallel)  # the shard path's PyTorch ops on CUDA tensors (float64 masses included) against gathering, one GPU
      # shellcheck disable=SC2086
      step "${PARALLEL_LIMIT:-150}" parallel python3 benchmarks/parallel.py \
        ${PARALLEL_ARGS:---device cuda --worlds 1 --B 32 --K 8 --V 128256} --out "$OUT/gpu-parallel.json"
      tail -n 14 "$OUT/parallel.log" | tee -a "$log" ;;
    check) bash "$0" warmup tests demo latency ;;
    measure) TESTS_LIMIT=120 LATENCY_LIMIT=100 BENCH_LIMIT=240 bash "$0" flashinfer latency bench tests ;;
    *) echo "unknown phase: $phase" >&2; exit 2 ;;
  esac
done
# FlashInfer's modules still building when the phases are done: nothing here reads them any more (the device tool
# would kill the build at the call's end anyway); say so, and stop it (the subshell, then the step it runs)
if [ -n "${fi_build:-}" ] && kill -0 "$fi_build" 2>/dev/null; then
  say "[flashinfer] still building when the phases ended (built: $(find "$FI_STATE" -type f -printf '%f ' \
2>/dev/null)): stopped"
  kids=$(pgrep -P "$fi_build")
  kill "$fi_build" 2>/dev/null
  # shellcheck disable=SC2086
  [ -n "$kids" ] && kill $kids 2>/dev/null
  wait "$fi_build" 2>/dev/null
fi
