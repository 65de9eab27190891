"""The GLM-5 / DeepSeek-V3.2 model family in torch (MLA + lightning indexer + sparse attention + MoE)."""
