#!/usr/bin/env bash
# The vLLM connector core on GPUs: run as `tools/gpu_e2e.sh vllm` (which installs ./.whl and sets
# PYTHONPATH first), from the project root. vLLM itself is not installed there (its CUDA wheel needs
# another torch): the core is fed CUDA KV caches laid out as vLLM 0.32 allocates them.
#   1. tests/gpu/test_vllm_gpu.py: every layout in two processes (prefill cuda:0, decode cuda:1 when
#      two GPUs are visible, else both on cuda:0), every byte; the long-kernel layer readiness tests
#   2. tools/bench_vllm_core.py: last layer's kernels end -> decode reports the blocks loaded,
#      1K and 16K tokens, FlashAttention's layout (LBNHC), layer-wise
# Results go to $OUT (or ./gpu-out). Under 8 minutes on one or two H100s.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi -L | tee "$OUT/vllm-gpus.txt"
TE_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_vllm_gpu.py 2>&1 \
  | grep -v "NIXL INFO" | tee "$OUT/vllm-gpu-tests.txt" | tail -30
timeout 140 python3 tools/bench_vllm_core.py --tokens 1024,16384 --reps 10 2>&1 | grep -v "NIXL INFO" \
  | tee "$OUT/vllm-gpu-bench.txt" | tail -12
