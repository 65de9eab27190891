#!/usr/bin/env bash
# Triton NVFP4 MoE on one CUDA GPU: its CUDA tests (GLM-5 shapes in both weight layouts, CUDA-graph
# replay, every code and scale through the re-laid-out path), then bench/kernels/bench_moe.py: the
# checkpoint layout, the re-laid-out one (the default) and the re-laid-out one in tiles side by side
# at every batch, then a sweep at batch 1 (split-K gate/up, the down blocks), then the align step
# alone both ways (one launch, chunked) from 256 to 16384 tokens. Writes $OUT/moe/{log.txt,results.json}; about 190 s.
# Usage (from the repository root, nsaserve importable): OUT=dir bash bench/gpu/moe.sh
set -uo pipefail
out="${OUT:?set OUT}/moe"
mkdir -p "$out"
log="$out/log.txt"
tmp=$(mktemp -d)
t=tests/kernels/test_triton_moe.py
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  # GLM-5 shapes (every layout) and graph replay first: they matter most if time runs out.
  timeout 45 python3 -m pytest -v -p no:cacheprovider "$t" -k "glm5 or cuda_graph" 2>&1 | grep -v "^$"
  echo "GLM-5/graph tests exit: ${PIPESTATUS[0]}"
  # Every code and scale through the re-laid-out inline assembly; split-K gate/up; the model's
  # triton backend re-laying out its stacks in place against the torch reference.
  timeout 75 python3 -m pytest -q -p no:cacheprovider "$t" tests/model/test_triton_moe_model.py \
    -k "relayout or split_k or tiled or align or layout" 2>&1 | tail -4
  echo "relayout/split-K/model tests exit: ${PIPESTATUS[0]}"
  PYTHONPATH="$PYTHONPATH:bench/kernels" timeout 75 python3 bench/kernels/bench_moe.py --out "$tmp" \
    --batches 1,64,256,1024 --sweep 1 --torch-batches "" --align 256,512,1024,2048,16384 \
    --partial "$out/results.json" 2>&1
  echo "bench exit: $?"
} > "$log" 2>&1
cp "$tmp"/*.json "$out/results.json" 2>/dev/null
cat "$tmp"/*.md >> "$log" 2>/dev/null
rm -rf "$tmp"
tail -45 "$log"
