#!/usr/bin/env bash
# GPU smoke check on one CUDA device: the CUDA variants of the kernel, sampler and model tests,
# the end-to-end API tests against a server on the GPU, and a small load sweep on the embedded
# model. Usage: bash bench/gpu_smoke.sh OUT_DIR   (nsaserve importable, e.g. PYTHONPATH=pyworker)
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
cd "$(dirname "$0")/.."
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/device.txt"

python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda_matches_cpu.py tests/kernels tests/worker/test_sampler_seeds.py \
  > "$out/pytest_cuda.txt" 2>&1
echo "cuda tests: $(tail -1 "$out/pytest_cuda.txt")"

NSASERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/server/test_openai_api.py tests/server/test_serve_process.py \
  > "$out/pytest_e2e_cuda.txt" 2>&1
echo "e2e on cuda: $(tail -1 "$out/pytest_e2e_cuda.txt")"

port=30777
python3 -m nsaserve serve --device cuda --port $port --max-running-requests 256 > "$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do grep -q "nsaserve ready" "$out/serve.log" && break; sleep 1; done
python3 -m nsaserve bench --port $port --tokenizer pyworker/nsaserve/embedded_model --random-input-len 256 \
  --random-output-len 64 --random-range-ratio 0.8 --concurrency 16,64,256 --prompts-per-concurrency 4 \
  --warmup-requests 8 --disable-tqdm --output-file "$out/bench_embedded_cuda.json" > "$out/bench.txt" 2>&1
echo "bench: exit $?"; tail -12 "$out/bench.txt"
kill -TERM $pid; wait $pid
echo "serve exit: $?"
