#!/usr/bin/env bash
# One device-tool call of a GPU session, run from the repository root on the GPU machine (its image
# has torch, triton, pytest, hypothesis, scipy and transformers; nothing is installed). Writes logs and
# results under $OUT (default ./gpu-out). Each phase fits the tool's 10-minute limit on an H100/H200:
#
#   bash benchmarks/gpu_session.sh check   # every kernel test and the GPU-only tests on the GPU
#   bash benchmarks/gpu_session.sh exact   # the exactness Monte Carlo against the kernels, full size
#   bash benchmarks/gpu_session.sh bench   # benchmarks/gpu.py -> $OUT/gpu-<device>.json (+ FlashInfer
#                                          #   baselines when .flashinfer/ is carried: flashinfer_carry.sh)
set -uo pipefail
phase=${1:?check, exact or bench}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
case "$phase" in
  check)
    python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_kernels_sampling.py \
      tests/test_kernels_chain.py tests/test_kernels_chain_logits.py tests/test_kernels_tree.py \
      tests/test_kernels_tree_logits.py tests/test_kernels_mlc.py tests/test_backend.py 2>&1 | tee "$OUT/check.log"
    ;;
  exact)
    SPECSAMPLER_FULL_MC=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_exactness.py \
      tests/test_mlc_sampler.py tests/test_mlc_verify.py 2>&1 | tee "$OUT/exact.log"
    ;;
  bench)
    if [ -f .flashinfer/flashinfer.tgz ]; then
      mkdir -p /tmp/fi && tar xzf .flashinfer/flashinfer.tgz -C /tmp/fi \
        && python3 -m pip install -q --no-index --no-deps --target /tmp/fi .flashinfer/apache_tvm_ffi-*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/fi"
      python3 -c "import flashinfer.sampling" 2>&1 | tail -3 | tee "$OUT/flashinfer.log"
    fi
    name=$(python3 -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
    python3 benchmarks/gpu.py --out "$OUT/gpu-$name.json" 2>&1 | tee "$OUT/bench.log"
    ;;
  *) echo "unknown phase: $phase" >&2; exit 2 ;;
esac
