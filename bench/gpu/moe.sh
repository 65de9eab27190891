#!/usr/bin/env bash
# Triton NVFP4 MoE on one CUDA GPU: its CUDA tests (GLM-5 shapes, CUDA-graph replay), the model-level
# backend comparison, then bench/kernels/bench_moe.py. Writes $OUT/moe/{log.txt,results.json}.
# Usage (from the repository root, nsaserve importable): OUT=dir bash bench/gpu/moe.sh
set -uo pipefail
out="${OUT:?set OUT}/moe"
mkdir -p "$out"
log="$out/log.txt"
tmp=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  # GLM-5 shapes and graph replay first: they matter most if the time runs out.
  t=tests/kernels/test_triton_moe.py
  timeout 40 python3 -m pytest -v -p no:cacheprovider "$t" -k "glm5 or cuda_graph" 2>&1 | grep -v "^$"
  echo "GLM-5 tests exit: ${PIPESTATUS[0]}"
  timeout 30 python3 -m pytest -v -p no:cacheprovider "$t" tests/model/test_triton_moe_model.py \
    -k "not glm5 and not cuda_graph" 2>&1 | grep -v "^$"
  echo "tests exit: ${PIPESTATUS[0]}"
  PYTHONPATH="$PYTHONPATH:bench/kernels" timeout 72 python3 bench/kernels/bench_moe.py --out "$tmp" \
    --batches 1,64,256,1024 --sweep 1,256 --torch-batches 1,64 --partial "$out/results.json" 2>&1
  echo "bench exit: $?"
} > "$log" 2>&1
cp "$tmp"/*.json "$out/results.json" 2>/dev/null
cat "$tmp"/*.md >> "$log" 2>/dev/null
rm -rf "$tmp"
tail -40 "$log"
