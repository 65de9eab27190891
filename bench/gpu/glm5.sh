#!/usr/bin/env bash
# Rehearsal of bench/gpu/glm5_sweep.sh that fits a ~200 s call: the final run's checkpoint
# (3 dense + 6 MoE layers at GLM-5 shapes, ~41 GB, generated on the GPU), transformers side by side
# at 3 dense + 1 MoE layers first, then levels 64 and 256 with short prompts and outputs (the decode
# step at 256 against its roofline). Results in OUT/glm5/.
set -uo pipefail
cd "$(dirname "$0")/../.."
GLM5_BUDGET_S=${GLM5_BUDGET_S:-180} bash bench/gpu/glm5_sweep.sh --phases compare,sweep \
  --moe-layers 6 --levels 64,256 --input-len 256 --output-len 8 --range-ratio 0.8 --prefill-probes 3 \
  --compare-moe-layers 1 --compare-batch 16 --compare-input-len 256 --compare-output-len 16 "$@"
