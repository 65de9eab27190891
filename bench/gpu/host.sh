#!/usr/bin/env bash
# Host time of the eager forward step on one CUDA GPU: the host-sync CUDA test, then
# bench/kernels/bench_step_host.py (GLM-5-shaped, 1 dense + 2 MoE layers, both host paths in
# one run). Writes $OUT/host/{log.txt,results.json}. At most ~120 s.
# Usage (from the repository root, nsaserve importable): OUT=dir bash bench/gpu/host.sh
set -uo pipefail
out="${OUT:?set OUT}/host"
mkdir -p "$out"
log="$out/log.txt"
tmp=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  timeout 35 python3 -m pytest -q -x -p no:cacheprovider tests/model/test_host_syncs.py \
    -k "triton_backends" 2>&1 | grep -v "^$" | tail -15
  echo "tests exit: ${PIPESTATUS[0]}"
  PYTHONPATH="$PYTHONPATH:bench/kernels" timeout 78 python3 bench/kernels/bench_step_host.py --out "$tmp" \
    --partial "$out/results.json" 2>&1 | grep -v -i "warn"
  echo "bench exit: ${PIPESTATUS[0]}"
} > "$log" 2>&1
cp "$tmp"/*.json "$out/results.json" 2>/dev/null
cat "$tmp"/*.md >> "$log" 2>/dev/null
rm -rf "$tmp"
tail -45 "$log"
