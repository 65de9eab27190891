#!/usr/bin/env bash
# GLM-5 at full or half depth on several GPUs of one host: every rank draws its weights at load
# (--random-weights: nothing on disk), FP8 KV, radix cache on, decode CUDA graphs at 14 batch
# sizes up to 1024 and contexts 1024 and 2048, random 1K in / 1K out at range ratio 0.8.
#   OUT=DIR GLM5_TP=8 GLM5_MOE_LAYERS=75 bash bench/gpu/glm5_tp.sh [more glm5_sweep.py flags]
#   GLM5_TP=4 GLM5_MOE_LAYERS=36 (the default): half depth on four GPUs, the same layers per GPU
# Pass --serve-arg=--enable-dp-attention for data-parallel attention (its own KV per rank).
# Writes OUT/glm5/{log.txt,results.json}; needs nsaserve importable (PYTHONPATH=pyworker).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
sizes=()
for b in 1 2 4 8 16 32 64 128 192 256 384 512 768 1024; do sizes+=("--serve-arg=$b"); done
GLM5_BUDGET_S=${GLM5_BUDGET_S:-530} bash bench/gpu/glm5_sweep.sh --tp "${GLM5_TP:-4}" --random-weights \
  --moe-layers "${GLM5_MOE_LAYERS:-36}" --phases sweep,shared --levels "${GLM5_LEVELS:-64,256,512,1024}" \
  --warmup-prompts 64 --input-len 1024 --output-len 1024 --range-ratio 0.8 --prefill-probes 3 \
  --shared-conversations 64 --shared-concurrency 64 --shared-output-len 64 --ready-timeout-s 300 \
  --serve-arg=--mem-fraction-static=0.88 --serve-arg=--cuda-graph-max-context=2048 \
  --serve-arg=--cuda-graph-bs "${sizes[@]}" "$@"
