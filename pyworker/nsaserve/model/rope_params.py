"""RoPE frequencies and the YaRN softmax-scale correction, from the config's rope parameters.

YaRN (DeepSeek-V3.x): frequencies blend interpolated (theta^(-2i/d) / factor) and extrapolated
(theta^(-2i/d)) values with a linear ramp between the dims that rotate beta_fast and beta_slow times
over the original context; cos/sin are multiplied by attention_factor (default
mscale(factor, mscale) / mscale(factor, mscale_all_dim)); and the MLA softmax scale is multiplied by
mscale(factor, mscale_all_dim)^2, with mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [dim/2], attention_factor) for the rope dims."""
    theta = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base_freq = theta**exponents  # wavelength / 2pi per pair
    if params["rope_type"] == "default":
        return 1.0 / base_freq, 1.0
    factor = params.get("factor")
    orig = float(params["original_max_position_embeddings"])
    if factor is None:
        factor = max_position_embeddings / orig
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if m and m_all:
            attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dim index whose wavelength completes `rotations` turns over the original context.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 = keep the original frequency (fast dims)
    inv_freq = (1.0 / (factor * base_freq)) * (1 - extrapolate) + (1.0 / base_freq) * extrapolate
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, params: dict) -> float:
    scale = qk_head_dim**-0.5
    if params["rope_type"] != "default":
        m_all = params.get("mscale_all_dim", 0)
        if m_all:
            m = yarn_mscale(float(params["factor"]), m_all)
            scale = scale * m * m
    return scale
