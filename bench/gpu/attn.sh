#!/usr/bin/env bash
# Triton indexer + sparse MLA on one GPU, in one bounded run: the CUDA tests of both kernels and
# the model-level test with the Triton backends (in parallel: they mostly compile), then both
# benchmarks (alone on the GPU, each with copy bandwidth and matmul rate
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
timeout 60 python -m pytest -q tests/kernels/test_triton_indexer.py >"$work/t_idx.txt" 2>&1 &
p1=$!
timeout 60 python -m pytest -q tests/kernels/test_triton_sparse_mla.py -k matches_reference >"$work/t_mla.txt" 2>&1 &
p2=$!
timeout 60 python -m pytest -q tests/kernels/test_triton_sparse_mla.py -k "not matches_reference" >"$work/t_mla2.txt" 2>&1 &
p4=$!
timeout 60 python -m pytest -q tests/model/test_triton_backend.py >"$work/t_model.txt" 2>&1 &
p3=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p4; r2b=$?
wait $p3; r3=$?
for f in t_idx t_mla t_mla2 t_model; do echo "-- $f" >>"$log"; tail -25 "$work/$f.txt" >>"$log"; done

# The indexer bench (variants first, then the table) gets what the tests left of 145 s, less 40 s
# kept for the sparse MLA bench; both print rows as they go, so a timeout still leaves numbers.
left=$((145 - (SECONDS - start) - 40))
stamp "indexer bench"
(cd bench/kernels && timeout $((left > 25 ? left : 25)) python bench_indexer.py --out "$work") >>"$log" 2>&1
r4=$?
stamp "sparse mla bench"
(cd bench/kernels && timeout 40 python bench_sparse_mla.py --quick --out "$work") >>"$log" 2>&1
r5=$?
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
echo "attn summary: rc tests indexer=$r1 sparse_mla=$r2/$r2b model=$r3; indexer_bench=$r4 mla_bench=$r5; $((SECONDS - start)) s"
for f in t_idx t_mla t_mla2 t_model; do echo "$f: $(tail -1 "$work/$f.txt")"; done
for f in "$work"/*.md; do [ -f "$f" ] && sed -n '/^| /p' "$f"; done
rm -rf "$work"
