#!/usr/bin/env bash
# Lightning indexer on one CUDA GPU in one bounded run (about 150 s): its CUDA tests (the fp8
# query mode against its torch reference, the committed path, the model with the Triton indexer
# and its CUDA-graph decode; in parallel: they mostly compile), then bench/kernels/bench_indexer.py's
# side-by-side table (current vs new modes, prefill 8K/2K and decode batch 1/64 at 4K, with copy
# bandwidth and matmul rate measured in the same run). Writes $OUT/idx/{log.txt,results.json}.
# Usage (from the repository root, nsaserve importable): OUT=dir bash bench/gpu/idx.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
dest="${OUT:?set OUT}/idx"
mkdir -p "$dest"
log="$dest/log.txt"
work=$(mktemp -d)
start=$SECONDS
export PYTHONPATH="$PWD/pyworker:${PYTHONPATH:-}"  # this tree's nsaserve
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_indexer.py \
    -k "fp8_query or quantize or registered or (default and decode) or (whole_prompt and True) or (hard_rows and 1024)" >"$work/t1.txt" 2>&1 &
  p1=$!
  timeout 75 python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda_graphs.py >"$work/t2.txt" 2>&1 &
  p2=$!
  timeout 75 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_backend.py >"$work/t3.txt" 2>&1 &
  p3=$!
  wait $p1; r1=$?
  wait $p2; r2=$?
  wait $p3; r3=$?
  for t in t1 t2 t3; do echo "-- $t"; tail -12 "$work/$t.txt"; done
  echo "tests exit: indexer=$r1 cuda_graphs=$r2 model_triton=$r3 (t=$((SECONDS - start)) s)"
  left=$((150 - (SECONDS - start)))
  timeout $((left > 30 ? left : 30)) python3 bench/kernels/bench_indexer.py --out "$work" 2>&1
  echo "bench exit: $? (t=$((SECONDS - start)) s)"
} >"$log" 2>&1
cp "$work"/*.json "$dest/results.json" 2>/dev/null
cat "$work"/*.md >>"$log" 2>/dev/null
sed -i "s#$work#OUT#g; s#${OUT}#OUT#g" "$log" "$dest/results.json" 2>/dev/null
rm -rf "$work"
grep -E "exit:|^copy " "$log"
sed -n '/^| case/,$p' "$log" | head -30
