#!/usr/bin/env bash
# Small-op kernels, the router logits, the sampler's pick and CUDA-graph decode on one GPU: the CUDA
# tests, then the four benchmarks.
# Usage (repository root, nsaserve importable): OUT=dir bash bench/gpu/fused.sh   (at most ~180 s)
# Writes $OUT/fused/log.txt (test output, markdown tables) and $OUT/fused/results.json.
set -uo pipefail
out=${OUT:?set OUT}/fused
mkdir -p "$out"
tmp=$(mktemp -d)
log=$out/log.txt
# Each stage gets its own budget, cut so that the whole script ends by 180 s.
within() { local left=$((180 - SECONDS)); [ "$1" -lt "$left" ] && echo "$1" || echo $((left > 5 ? left - 5 : 1)); }
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' > "$log" 2>&1

timeout "$(within 45)" python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda_graphs.py \
  tests/kernels/test_graph_safe_references.py > "$tmp/pytest.txt" 2>&1
echo "pytest (graphs) exit $?" >> "$tmp/pytest.txt"
timeout "$(within 35)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_small_ops.py \
  tests/kernels/test_router_logits.py tests/kernels/test_sample_pick.py >> "$tmp/pytest.txt" 2>&1
echo "pytest (small ops) exit $?" >> "$tmp/pytest.txt"
cat "$tmp/pytest.txt" >> "$log"

timeout "$(within 32)" python3 bench/kernels/bench_small_ops.py --out "$tmp" --tokens 1,64,4096,16384 > "$tmp/small_ops.txt" 2>&1
echo "bench_small_ops exit $?" >> "$tmp/small_ops.txt"
timeout "$(within 28)" python3 bench/kernels/bench_decode_graphs.py --out "$tmp" --batches 1,8,32,64 > "$tmp/graphs.txt" 2>&1
echo "bench_decode_graphs exit $?" >> "$tmp/graphs.txt"
{ timeout "$(within 20)" python3 bench/kernels/bench_router_logits.py --out "$tmp" --tokens 1,64,256,16384 &&
  timeout "$(within 15)" python3 bench/kernels/bench_sample_pick.py --out "$tmp"; } > "$tmp/router_pick.txt" 2>&1
echo "bench_router_logits / bench_sample_pick exit $?" >> "$tmp/router_pick.txt"
cat "$tmp/small_ops.txt" "$tmp/graphs.txt" "$tmp/router_pick.txt" "$tmp"/*.md >> "$log" 2>/dev/null
python3 - "$tmp" "$out/results.json" <<'PY'
import glob, json, sys
tmp, dst = sys.argv[1:]
json.dump({p.rsplit("/", 1)[1]: json.load(open(p)) for p in sorted(glob.glob(tmp + "/*.json"))}, open(dst, "w"), indent=1)
PY
echo "== fused summary ($SECONDS s) =="
grep -E "passed|failed|exit" "$tmp/pytest.txt" | tail -6
tail -n 36 "$tmp/small_ops.txt" | cut -c1-110
tail -n 8 "$tmp/graphs.txt" | cut -c1-140
grep -E "^ *[0-9]+ +(float32|bf16x3 chunk 384|torch|triton)|exit" "$tmp/router_pick.txt" | cut -c1-110
rm -rf "$tmp"
