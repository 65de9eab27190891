#!/usr/bin/env bash
# Small-op kernels and CUDA-graph decode on one GPU: the CUDA tests, then the benchmarks.
# Usage (repository root, nsaserve importable): OUT=dir bash bench/gpu/fused.sh
# Writes $OUT/fused/log.txt (test output, markdown tables) and $OUT/fused/results.json.
set -uo pipefail
out=${OUT:?set OUT}/fused
mkdir -p "$out"
tmp=$(mktemp -d)
log=$out/log.txt
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' > "$log" 2>&1

timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_small_ops.py \
  tests/model/test_small_op_backends.py >> "$log" 2>&1
echo "small-op tests: $(tail -1 "$log")"

timeout 60 python3 bench/kernels/bench_small_ops.py --out "$tmp" --tokens 1,64,1024,16384 > "$tmp/small_ops.txt" 2>&1
cat "$tmp/small_ops.txt" >> "$log"
cat "$tmp"/*small-ops.md >> "$log" 2>/dev/null
python3 - "$tmp" "$out/results.json" <<'PY'
import glob, json, sys
tmp, dst = sys.argv[1:]
json.dump({p.rsplit("/", 1)[1]: json.load(open(p)) for p in sorted(glob.glob(tmp + "/*.json"))}, open(dst, "w"), indent=1)
PY
tail -n 45 "$tmp/small_ops.txt"
rm -rf "$tmp"
