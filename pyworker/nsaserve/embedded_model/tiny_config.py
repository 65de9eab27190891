"""The embedded model's architecture: GLM-5 (`glm_moe_dsa`) shrunk to a few MB, every feature kept.

8 attention heads, 8 routed experts and intermediate sizes divisible by 8, so it runs at every
tensor-parallel size up to 8 (heads and experts split evenly across ranks).

Kept on purpose, so the model exercises the serving paths a real checkpoint does:
- MLA with separate q/kv LoRA ranks and decoupled RoPE dims (nope/rope/v all different from each other);
- the lightning indexer with 16 heads of 128 dims (the indexer key is one 128-wide vector per token, as in
  GLM-5, so the FP8 indexer-key layout is unchanged). Few heads would make ReLU zero out many scores and
  leave top-k choosing among exact ties, which differ between cached and uncached runs;
- `index_topk` 64, below the recital length (~195 tokens), so sparse selection happens while reciting;
- one dense layer then one MoE layer (8 routed experts, top-2, one shared expert, sigmoid routing with a
  non-zero score-correction bias and a routed scaling factor), as in GLM-5's dense-then-MoE stack.
"""

from transformers import GlmMoeDsaConfig

INDEX_TOPK = 64


def tiny_config(vocab_size: int, bos_token_id: int, eos_token_ids: list[int], pad_token_id: int) -> GlmMoeDsaConfig:
    return GlmMoeDsaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=48,
        qk_rope_head_dim=32,
        v_head_dim=40,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=INDEX_TOPK,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
    )
