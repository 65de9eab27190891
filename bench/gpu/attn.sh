#!/usr/bin/env bash
# Triton indexer + sparse MLA on one GPU, in one bounded run: the CUDA tests of both kernels and
# the model-level test with the Triton backends (in parallel: they mostly compile), then the
# variant sweep and both benchmarks (alone on the GPU, each with copy bandwidth and matmul rate
# measured in the same run). Writes $OUT/attn/{log.txt,results.json}; prints a summary last.
# Usage: OUT=/tmp/out PYTHONPATH=pyworker bash bench/gpu/attn.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
dest="${OUT:-/tmp}/attn"
mkdir -p "$dest"
log="$dest/log.txt"
work=$(mktemp -d)
: >"$log"
start=$SECONDS
stamp() { echo "== $1 (t=$((SECONDS - start)) s)" | tee -a "$log"; }

stamp "tests"
timeout 55 python -m pytest -q tests/kernels/test_triton_indexer.py >"$work/t_idx.txt" 2>&1 &
p1=$!
timeout 55 python -m pytest -q tests/kernels/test_triton_sparse_mla.py >"$work/t_mla.txt" 2>&1 &
p2=$!
timeout 55 python -m pytest -q tests/model/test_triton_backend.py >"$work/t_model.txt" 2>&1 &
p3=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
for f in t_idx t_mla t_model; do echo "-- $f" >>"$log"; tail -25 "$work/$f.txt" >>"$log"; done

stamp "indexer sweep"
# Whatever the tests left of 145 s, less 45 s kept for the sparse MLA bench (rows print as they go).
left=$((145 - (SECONDS - start) - 45))
(cd bench/kernels && timeout $((left > 20 ? left : 20)) python sweep_indexer.py --json "$work/sweep.json") >>"$log" 2>&1
r4=$?
r5=skipped
if [ "${ATTN_INDEXER_BENCH:-0}" = 1 ]; then
  stamp "indexer bench"
  (cd bench/kernels && timeout 40 python bench_indexer.py --out "$work") >>"$log" 2>&1
  r5=$?
fi
stamp "sparse mla bench"
(cd bench/kernels && timeout 45 python bench_sparse_mla.py --quick --out "$work") >>"$log" 2>&1
r6=$?
stamp "done"

python - "$work" "$dest/results.json" <<'PY'
import glob, json, os, sys
work, dest = sys.argv[1], sys.argv[2]
out = {}
for f in sorted(glob.glob(os.path.join(work, "*.json"))):
    with open(f) as fh:
        out[os.path.basename(f)] = json.load(fh)
for f in sorted(glob.glob(os.path.join(work, "*.md"))):
    with open(f) as fh:
        out[os.path.basename(f)] = fh.read()
with open(dest, "w") as fh:
    json.dump(out, fh, indent=1)
PY
echo
echo "attn summary: rc tests indexer=$r1 sparse_mla=$r2 model=$r3; sweep=$r4 indexer_bench=$r5 mla_bench=$r6; $((SECONDS - start)) s"
for f in t_idx t_mla t_model; do echo "$f: $(tail -1 "$work/$f.txt")"; done
for f in "$work"/*.md; do [ -f "$f" ] && sed -n '/^| /p' "$f"; done
rm -rf "$work"
