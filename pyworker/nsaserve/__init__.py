"""nsaserve: a serving engine for sparse-attention Mixture-of-Experts LLMs (GLM-5, DeepSeek-V3.2)."""

__version__ = "0.1.0"
