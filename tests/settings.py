"""Sizes shared by fixtures (conftest.py) and tests: the real-model conversion and the synthetic ReLU model."""

from __future__ import annotations

from pi2_gguf.converter import synthetic

SMOL_TARGET = 0.5
SMOL_TRAIN_TOKENS = 2048
SMOL_HELDOUT_TOKENS = 512

# a small ReLU model: 4 layers, 256 x 1024 FFN, F32 (sparse vs dense then differ only by float rounding)
RELU_SHAPE = synthetic.Shape(n_embd=256, n_ff=1024, n_layer=4, n_head=4, n_head_kv=2, n_ctx=512)
RELU_DENSITY = 0.10
