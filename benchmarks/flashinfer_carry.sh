#!/usr/bin/env bash
# Packs FlashInfer's sampling path small enough to carry to a GPU machine without network access
# (the device tool takes at most 64 MiB of working tree per call; the flashinfer-python wheel alone
# is 62 MiB). Keeps every Python module (`import flashinfer` imports them all) and, of the data
# its JIT compiles from, only the sampling sources, their headers, CCCL and spdlog; drops the other
# kernels' sources, CUTLASS (not included by sampling) and tuning tables; keeps the top-k module's sources, which
# top_k_top_p_sampling_from_logits compiles on first use. apache-tvm-ffi, which
# FlashInfer 0.7 binds its kernels with, is the one import the GPU image lacks.
#
#   bash benchmarks/flashinfer_carry.sh [DIR]    # DIR defaults to .flashinfer (git-ignored)
#
# On the GPU machine `benchmarks/gpu_session.sh bench` unpacks it and JIT-compiles the sampling module (nvcc and
# ninja are there; it also finds the CUDA headers and libraries the module needs). By hand:
#   tar xzf DIR/flashinfer.tgz -C /tmp/fi && python3 -m pip install -q --no-index --no-deps \
#     --target /tmp/fi DIR/apache_tvm_ffi-*.whl && export PYTHONPATH=/tmp/fi
set -euo pipefail
VERSION=0.7.2
out=$(realpath -m "${1:-.flashinfer}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$work" "flashinfer-python==$VERSION" \
  "apache-tvm-ffi>=0.1.11,<0.2"
(cd "$work" && python3 -m zipfile -e flashinfer_python-"$VERSION"-py3-none-any.whl unpacked)
fi="$work/unpacked/flashinfer"
# the sampling module's sources, and the top-k module's, which top_k_top_p_sampling_from_logits builds too
find "$fi/data/csrc" -mindepth 1 -maxdepth 1 ! -name sampling.cu ! -name renorm.cu \
  ! -name flashinfer_sampling_binding.cu ! -name topk.cu ! -name cub_topk.cu ! -name flashinfer_topk_binding.cu \
  ! -name flashinfer_fast_topk_clusters_binding.cu ! -name '*.h' -exec rm -rf {} +
rm -rf "$fi/data/cutlass"
find "$fi" -path "$fi/data" -prune -o -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.c' \
  -o -name '*.cubin' -o -name '*.so' -o -name '*.md' -o -path '*/artifacts/*.json' \) -print0 | xargs -0 rm -f
find "$fi" -name __pycache__ -type d -prune -exec rm -rf {} +
tar czf "$out/flashinfer.tgz" -C "$work/unpacked" flashinfer
rm -f "$out"/apache_tvm_ffi-*.whl
cp "$work"/apache_tvm_ffi-*.whl "$out/"
du -sh "$out"/*
