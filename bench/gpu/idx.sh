#!/usr/bin/env bash
# Lightning indexer on one CUDA GPU in one bounded run (about 90 s): its CUDA tests (the fp8
# query mode against its torch reference, the committed path, the model's CUDA-graph decode with
# the Triton indexer), then bench/kernels/bench_indexer.py's side-by-side table (current vs new
# modes, prefill 2K/8K and decode batch 1/64 at 4K, with copy bandwidth and matmul rate measured
# in the same run). Writes $OUT/idx/{log.txt,results.json}; prints a summary last.
# Usage (from the repository root, nsaserve importable): OUT=dir bash bench/gpu/idx.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
dest="${OUT:?set OUT}/idx"
mkdir -p "$dest"
log="$dest/log.txt"
work=$(mktemp -d)
start=$SECONDS
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  timeout 32 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_indexer.py \
    -k "fp8_query or quantize or registered or (default and decode) or whole_prompt" 2>&1 | tail -15
  echo "indexer tests exit: ${PIPESTATUS[0]} (t=$((SECONDS - start)) s)"
  timeout 12 python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda_graphs.py 2>&1 | tail -4
  echo "graph tests exit: ${PIPESTATUS[0]} (t=$((SECONDS - start)) s)"
  left=$((86 - (SECONDS - start)))
  (cd bench/kernels && timeout $((left > 30 ? left : 30)) python3 bench_indexer.py --out "$work") 2>&1
  echo "bench exit: $? (t=$((SECONDS - start)) s)"
} >"$log" 2>&1
cp "$work"/*.json "$dest/results.json" 2>/dev/null
cat "$work"/*.md >>"$log" 2>/dev/null
sed -i "s#$work#OUT#g; s#${OUT}#OUT#g" "$log" "$dest/results.json" 2>/dev/null
rm -rf "$work"
grep -E "exit:|passed|failed|^copy " "$log"
sed -n '/^| case/,$p' "$log" | head -30
