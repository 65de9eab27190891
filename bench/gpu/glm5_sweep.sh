#!/usr/bin/env bash
# GLM-5-shaped NVFP4 checkpoint on one GPU: generate (or reuse) -> serve (FP8 KV, radix cache on)
# -> bench at each concurrency level + shared prefix -> decode step vs memory roofline -> the same
# weights at a smaller depth against transformers. Everything inside GLM5_BUDGET_S seconds.
#   OUT=DIR bash bench/gpu/glm5_sweep.sh [flags of bench/gpu/glm5_sweep.py]
# Writes OUT/glm5/{log.txt,results.json}; needs nsaserve importable (PYTHONPATH=pyworker).
# The issue's sweep (1K/1K, 64..1024; ~41 GB checkpoint made in ~25 s; server ready in ~60 s with
# 40 decode graphs, ~80 s with the 96 graphs up to batch 1024):
#   OUT=DIR GLM5_BUDGET_S=530 bash bench/gpu/glm5_sweep.sh --keep-model \
#     --phases compare,sweep,shared --moe-layers 6 --levels 64,256,512,1024 --level-waves 64:4 \
#     --warmup-prompts 64 --input-len 1024 --output-len 1024 --range-ratio 0.8 \
#     --shared-conversations 64 --shared-concurrency 64 --shared-output-len 256 \
#     --compare-moe-layers 1 --compare-batch 64 --compare-input-len 1024 --compare-output-len 256 \
#     --serve-arg=--cuda-graph-max-bs=1024 --serve-arg=--cuda-graph-max-context=4096
# For the TTFT target at 64 concurrent, run that level with 10 x concurrency prompts
# (--levels 64 --level-waves 64:10: 640 prompts, ~170 s of load on one H200), the practice of the
# InferenceX harness: with 4 waves the first burst of 64 prompts is a quarter of the TTFT sample.
# What does not fit the budget is listed under "skipped"; a second call with --levels set to those
# reuses the kept checkpoint. With the torch reference kernels only, shorten: --input-len 256
# --output-len 8 --shared-output-len 8 --compare-batch 16 --compare-input-len 256 --compare-output-len 16.
# --cuda-graph-max-context=4096 covers the shared-prefix workload's contexts (2K system prompt +
# turns, ~2.4K) as a default server (graphs to the whole context length) does; with 2048 that phase
# decodes eagerly, bound by the host's launches (TPOT 37.0 against 12.7 ms on graphs at 64
# concurrent, 2026-12-02). results.json's shared_prefix_decode says which ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:?set OUT to the output directory}/glm5
mkdir -p "$out"
budget=${GLM5_BUDGET_S:-530}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm --format=csv 2>&1
  df -h / /tmp /dev/shm 2>&1
  free -g 2>&1
  python3 -c 'import transformers as t; print("transformers", t.__version__, "GlmMoeDsa:", hasattr(t, "GlmMoeDsaForCausalLM"), "DeepseekV32:", hasattr(t, "DeepseekV32ForCausalLM"))' 2>&1
} >> "$out/log.txt"
timeout -k 10 $((${budget%.*} + 10)) python3 bench/gpu/glm5_sweep.py --out "$out" --budget-s "$budget" "$@"
rc=$?
echo "glm5_sweep exit $rc"
exit $rc
