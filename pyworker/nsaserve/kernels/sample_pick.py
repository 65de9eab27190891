"""The sampler's last step: one token per row, argmax(x + Gumbel(u)) (argmax(x) on greedy rows).

Kind "sample_pick": (x float32 [S, V] the processed logits, u float32 [S, V] uniforms in [0, 1),
greedy bool [S] or None, temperature float32 [S] or None, threshold float32 [S] or None) -> int64
[S]. Ties go to the lowest token id, as torch.argmax's. With temperature, x is the raw (penalised)
logits (any float dtype) and the pick divides them first, x.float() / temperature (1 on greedy
rows), exactly as the sampler's process_logits does; with threshold (sample_threshold.py), tokens
whose divided logit is below their row's threshold are out, as process_logits' filters make them
-inf. The fused backend then saves those passes over [S, V].

The noise is G = -log(-log u) (worker/sampling_noise.py says why this samples the distribution).
The torch reference below makes a tensor per operation: about eight passes over [S, V] float32,
which at GLM-5's vocabulary (154,880) and 1024 rows is 634 MB a pass. The "triton" backend
(triton_sample_pick.py) reads x and u once and writes one value and index per piece of a row.
"""

from __future__ import annotations

import torch

from .registry import register


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """-log(-log u): finite, or -inf where u == 0 (that token then never wins; no NaN can appear).

    u < 1 keeps -log u > 0; the clamp guards against a generator that rounds up to 1.0.
    """
    u = u.clamp(max=1.0 - 2.0**-24)
    return u.log().neg_().log_().neg_()


@register("sample_pick", "torch")
def sample_pick_torch(
    x: torch.Tensor,
    u: torch.Tensor,
    greedy: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    if temperature is not None:
        x = x.float() / temperature.unsqueeze(1)
    if threshold is not None:
        x = x.float().masked_fill(x < threshold.unsqueeze(1), float("-inf"))
    g = gumbel(u)
    if greedy is not None:
        g.masked_fill_(greedy.unsqueeze(1), 0.0)
    return g.add_(x).argmax(dim=1)
