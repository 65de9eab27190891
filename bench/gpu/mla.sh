#!/usr/bin/env bash
# Triton sparse MLA (GLM-5: 64 heads, d_qk 576, d_v 512, top-2048) on one CUDA GPU, bounded to ~90 s:
# the CUDA tests (launch variants and the committed launch against the torch reference) in parallel
# with a compile warm-up of every benchmarked launch (one process per config, shared on-disk cache),
# then bench/kernels/bench_sparse_mla.py alone on the GPU: all configs side by side at batch 64, 128,
# 256, 1 for both cache formats, copy bandwidth and matmul rate measured in the same run.
# Writes $OUT/mla/{log.txt,results.json,results.md}; prints a summary last.
# Usage (from the repository root): OUT=dir bash bench/gpu/mla.sh
set -uo pipefail
mkdir -p "${OUT:?set OUT}/mla"
out="$(cd "$OUT/mla" && pwd)"
cd "$(dirname "$0")/../.."
log="$out/log.txt"
tmp=$(mktemp -d)
export PYTHONPATH="$PWD/pyworker:$PWD/bench/kernels:${PYTHONPATH:-}"
start=$SECONDS
bench=bench/kernels/bench_sparse_mla.py
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  echo "== tests + warm-up (t=$((SECONDS - start)) s)"
  t=tests/kernels/test_triton_sparse_mla.py
  timeout 42 python3 -m pytest -q -p no:cacheprovider "$t" -k "variants and prefetch" >"$tmp/t1.txt" 2>&1 &
  p1=$!
  timeout 42 python3 -m pytest -q -p no:cacheprovider "$t" -k "variants and not prefetch" >"$tmp/t4.txt" 2>&1 &
  p4=$!
  timeout 42 python3 -m pytest -q -p no:cacheprovider "$t" -k "test_matches_reference or test_split_counts" >"$tmp/t2.txt" 2>&1 &
  p2=$!
  timeout 42 python3 -m pytest -q -p no:cacheprovider "$t" -k "prefill" >"$tmp/t3.txt" 2>&1 &
  p3=$!
  pw=()
  # The x1 configs compile to the batch-128 kernels of default and pf-n32s3 (one split).
  for c in v2 default pf-n64s3 pf-n32s3 pf-n64s2-trim mask mask-trim; do
    pre="" b=64,128,256,1
    case $c in v2 | default) pre=$c ;; pf-n64s2-trim) pre=$c b="" ;; mask | mask-trim) b=64 ;; esac
    timeout 40 python3 "$bench" --warm --configs "$c" --batches "$b" --prefill "$pre" >"$tmp/w_$c.txt" 2>&1 &
    pw+=($!)
  done
  wait $p1; r1=$?
  wait $p2; r2=$?
  wait $p3; r3=$?
  wait $p4; r4=$?
  for p in "${pw[@]}"; do wait "$p"; done
  echo "-- tests (prefetch variants): rc $r1"; tail -15 "$tmp/t1.txt"
  echo "-- tests (indirect, mask_all variants): rc $r4"; tail -15 "$tmp/t4.txt"
  echo "-- tests (reference, splits): rc $r2"; tail -15 "$tmp/t2.txt"
  echo "-- tests (prefill): rc $r3"; tail -15 "$tmp/t3.txt"
  cat "$tmp"/w_*.txt
  left=$((84 - (SECONDS - start)))
  echo "== bench, budget $((left > 10 ? left - 6 : 4)) s (t=$((SECONDS - start)) s)"
  timeout $((left > 10 ? left : 10)) python3 "$bench" --out "$tmp" --budget $((left > 10 ? left - 6 : 4)) 2>&1
  echo "bench exit: $? (t=$((SECONDS - start)) s)"
} >"$log" 2>&1
cp "$tmp"/*.json "$out/results.json" 2>/dev/null
cp "$tmp"/*.md "$out/results.md" 2>/dev/null
rm -rf "$tmp"
echo "mla summary ($((SECONDS - start)) s): tests variants rc=$r1/$r4, reference rc=$r2, prefill rc=$r3"
grep -E "passed|failed" "$log" | grep -v "^E " | tail -6
sed -n '/^Fastest per case/,$p' "$log" | tail -60
