"""The GLM-5 / DeepSeek-V3.2 model family in torch (MLA + lightning indexer + sparse attention + MoE).

Entry point: runner.ModelRunner (load a checkpoint and its KV pool, run one ForwardBatch per step).

- config.py     config.json as transformers writes it (both model types), per-layer facts resolved
- rope_params   RoPE / YaRN frequencies and the MLA softmax-scale correction
- attention.py  MLA (absorbed, one latent head) + the lightning indexer; same path for prefill,
                decode and mixed batches, always reading the paged cache
- mlp.py        dense MLP and MoE (routed experts stacked per rank + shared experts)
- model.py      the decoder stack; parameter names mirror the checkpoint's
- linear.py     dense Linear / Norm weight holders (with the TP slice each rank reads)
- quant_linear  NVFP4 (W4A16) and 128x128 block-FP8 Linear layers, weights kept quantised; TP slicing
                of packed weights and scales
- expert_stack  routed experts stacked per rank in bf16 / NVFP4 / FP8, dequantised per expert on use
- weight_factory  picks each module's holder from the checkpoint's quantisation config
- loader.py     safetensors -> parameters, each rank reading only its slices
- kv_pool.py    the paged KV pool (latent + indexer key per slot per layer), bf16 or fp8
- parallel.py   the tensor-parallel layout (heads and experts split, indexer replicated)
- step_meta.py  metadata built once per forward and shared by all layers

Top-k contract (every indexer backend): contexts that fit in index_topk are attended densely;
otherwise the index_topk highest scores, ties going to the lower position.
"""
