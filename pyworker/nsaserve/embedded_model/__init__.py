"""The default model `nsaserve serve` uses when no `--model` is given.

This directory is a complete Hugging Face model directory (config.json, model.safetensors, tokenizer files,
generation_config.json) holding a tiny GLM-5-architecture model (`glm_moe_dsa`) trained to recite the Zen of
Python. The Python modules next to the model files rebuild it; see README.md.
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent
