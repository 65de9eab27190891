"""Training-time additions to transformers' GlmMoeDsaForCausalLM: forward hooks and a replaced indexer forward.

The LM forward stays transformers' own (so what we train is exactly what transformers and the server run);
the additions give what the LM loss alone cannot:

- Indexer training. Top-k selection is not differentiable, so the indexer gets no gradient from the LM loss.
  As in DeepSeek-V3.2's DSA training, each layer's index scores are fitted to that layer's attention: the
  loss is KL(p || softmax(I)), p = the attention probabilities summed over heads (detached), over the tokens
  the attention could see (all causal tokens in the dense warm-up, the selected ones once sparse). The
  indexer's inputs are detached so this loss only moves indexer weights.
- Selection noise. Once sparse, the indexer selects the top-k from the index scores plus Gumbel noise, which
  samples near-boundary tokens in and out. The LM learns not to depend on which of the weakly attended tokens
  made the cut, so serving-time perturbations (FP8 indexer keys, bf16) cannot flip the recital.
- FP8 simulation. With `fp8` on, the MLA latent and the indexer's q/k are rounded through float8_e4m3fn with a
  per-vector scale (straight-through gradient), as an FP8 KV cache stores them.
- Router gap and balance. A hinge on the gap between the last chosen and the first unchosen expert score
  keeps routing decisions far from ties, for the same robustness reason. Alone it collapses routing onto two
  experts for every token (the easiest way to a wide gap), so a balance term keeps every expert in use and
  the recital depends on routing each token to the right experts.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

FP8_MAX = 448.0
ROUTER_USAGE_TEMPERATURE = 0.05


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rounds each last-dim vector through e4m3 with scale amax/448; the gradient passes straight through."""
    scale = x.detach().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    rounded = (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return x + (rounded - x).detach()


@dataclass
class DsaTrainingState:
    """Switches read by the hooks, and the per-layer tensors they leave for the loss."""

    sparse: bool = False
    gumbel_scale: float = 0.0
    fp8: bool = False
    router_gap: float = 0.1
    generator: torch.Generator | None = None
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)
    router_gap_losses: list[torch.Tensor] = field(default_factory=list)
    router_balance_losses: list[torch.Tensor] = field(default_factory=list)

    def clear(self) -> None:
        self.index_scores.clear()
        self.allowed.clear()
        self.router_gap_losses.clear()
        self.router_balance_losses.clear()


def index_scores(indexer: glm.GlmMoeDsaIndexer, hidden, q_resid, position_embeddings, fp8: bool) -> torch.Tensor:
    """The indexer's scores I[b, s, t] (before masking), differentiable in the indexer's weights.

    Same formula as the transformers indexer: q from the MLA query latent, one LayerNorm'd key per token,
    interleaved RoPE on the first qk_rope_head_dim dims, I = sum_h w_h * relu(q_h . k / sqrt(d)).
    """
    batch, seq, _ = hidden.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    rope, rest = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, rest], dim=-1)
    k_rot, k_pass = torch.split(k, [rope, rest], dim=-1)
    q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if fp8:
        q, k = fake_fp8(q), fake_fp8(k)
    # One [B, S*H, D] x [B, D, T] product; broadcasting k over S and H would materialise a copy per query.
    heads = indexer.n_heads
    dots = torch.bmm(q.float().reshape(batch, seq * heads, -1), k.float().transpose(-1, -2))
    scores = F.relu(dots.view(batch, seq, heads, -1) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def allowed_keys(mask: torch.Tensor) -> torch.Tensor:
    """Causal/padding mask as booleans, whichever form (bool or additive float) transformers built."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def attach(model: glm.GlmMoeDsaForCausalLM, state: DsaTrainingState) -> list:
    """Installs the training behaviour on every layer; returns callables that undo it.

    The indexer's forward is replaced (not hooked) so its scores are computed once, with gradients.
    """
    undo = []
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.indexer.forward = _indexer_forward(attn.indexer, state)
        undo.append(lambda indexer=attn.indexer: delattr(indexer, "forward"))
        undo.append(attn.kv_a_layernorm.register_forward_hook(_latent_hook(state)).remove)
        if isinstance(layer.mlp, glm.GlmMoeDsaMoE):
            undo.append(layer.mlp.gate.register_forward_hook(_router_hook(state)).remove)
    return undo


def _indexer_forward(indexer: glm.GlmMoeDsaIndexer, state: DsaTrainingState):
    """Same arguments and result (top-k indices [B, S, k]) as GlmMoeDsaIndexer.forward."""

    def forward(hidden, q_resid, position_embeddings, mask, position_ids=None, cache=None):
        assert cache is None, "training runs without a KV cache"
        scores = index_scores(indexer, hidden.detach(), q_resid.detach(), position_embeddings, state.fp8)
        allowed = allowed_keys(mask)
        state.index_scores[indexer.layer_idx] = scores
        state.allowed[indexer.layer_idx] = allowed
        if not state.sparse:
            return torch.arange(scores.shape[-1], dtype=torch.int32).expand_as(scores)
        choice = scores.detach()
        if state.gumbel_scale > 0:
            uniform = torch.rand(choice.shape, generator=state.generator).clamp(1e-9, 1 - 1e-9)
            choice = choice - state.gumbel_scale * torch.log(-torch.log(uniform))
        choice = choice.masked_fill(~allowed, float("-inf"))
        topk = min(indexer.index_topk, choice.shape[-1])
        return choice.topk(topk, dim=-1).indices.to(torch.int32)

    return forward


def _latent_hook(state: DsaTrainingState):
    def hook(module, args, output):
        return fake_fp8(output) if state.fp8 else output

    return hook


def _router_hook(state: DsaTrainingState):
    def hook(gate, args, output):
        router_logits = output[0]
        scores = router_logits.sigmoid() + gate.e_score_correction_bias
        ranked = scores.topk(gate.top_k + 1, dim=-1).values
        gap = ranked[:, gate.top_k - 1] - ranked[:, gate.top_k]
        state.router_gap_losses.append(F.relu(state.router_gap - gap).mean())
        # Soft usage of each expert (a sharp softmax over the biased scores stands in for the top-k choice);
        # the loss is KL(uniform || usage), which grows without bound as any expert falls out of use.
        usage = (scores / ROUTER_USAGE_TEMPERATURE).softmax(-1).mean(0)
        state.router_balance_losses.append(-(usage * gate.num_experts).log().mean())

    return hook


def indexer_kl(attentions: tuple, state: DsaTrainingState, query_valid: torch.Tensor) -> torch.Tensor:
    """Mean over layers and valid queries of KL(attention summed over heads || softmax(index scores)).

    The index softmax is taken over the keys the attention actually saw (nonzero attention probability or,
    for exactly-zero ones, excluded), which is the causal set when dense and the selected set when sparse.
    """
    losses = []
    for layer_idx, scores in state.index_scores.items():
        attn = attentions[layer_idx].detach().float().sum(1)  # [B, S, T]
        target = attn / attn.sum(-1, keepdim=True).clamp(min=1e-20)
        seen = state.allowed[layer_idx] & (attn > 0)
        log_q = scores.masked_fill(~seen, float("-inf")).log_softmax(-1)
        kl = torch.where(seen, target * (target.clamp(min=1e-20).log() - log_q), torch.zeros_like(target)).sum(-1)
        losses.append((kl * query_valid).sum() / query_valid.sum())
    return torch.stack(losses).mean()
