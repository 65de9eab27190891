#!/usr/bin/env bash
# Rehearsal of bench/gpu/glm5_sweep.sh that fits a 240 s call: full GLM-5 layer shapes at a small
# depth (3 dense + 2 MoE layers), one short level at 64 concurrent, a small shared-prefix run and
# transformers side by side at 3 dense + 1 MoE layers. Results in OUT/glm5/.
set -uo pipefail
cd "$(dirname "$0")/../.."
GLM5_BUDGET_S=${GLM5_BUDGET_S:-180} bash bench/gpu/glm5_sweep.sh \
  --moe-layers 2 --levels 64 --input-len 1024 --output-len 16 --range-ratio 0.8 --prefill-probes 3 \
  --shared-conversations 8 --shared-concurrency 8 --shared-system-len 2048 --shared-question-len 128 \
  --shared-output-len 8 --shared-turns 2 \
  --compare-moe-layers 1 --compare-batch 8 --compare-input-len 512 --compare-output-len 16 "$@"
