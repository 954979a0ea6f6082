"""Which FFN neurons count as active: exact for ReLU-family models (act(gate) > 0), a per-layer
threshold on |act(gate)| calibrated for a target sparsity for SiLU/GELU models (CATS,
arXiv 2404.08763); plus the neuron ranking by activation frequency and the hot count."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import sidecar_format as fmt
from .model_ffn import activation_values

DEFAULT_SPARSITY = 0.5
HOT_SHARE = 0.5  # hot neurons: the fewest top-ranked neurons that carry this share of activations


@dataclass(frozen=True)
class SparsityPlan:
    """How a layer's active set is defined: method and either a target sparsity or a threshold."""

    method: str                   # "cats" or "relu"
    target: float | None = None   # fraction of inactive neurons to calibrate for (cats)
    threshold: float | None = None  # a given threshold for every layer (cats)

    @classmethod
    def for_activation(cls, activation: str, sparsity: float | None, threshold: float | None) -> SparsityPlan:
        if sparsity is not None and threshold is not None:
            raise ValueError("give a target sparsity or a threshold, not both")
        if activation in fmt.RELU_FAMILY:
            if sparsity is not None or threshold is not None:
                raise ValueError(f"a {activation} model is exactly sparse (active = act(gate) > 0); "
                                 "it takes no sparsity target or threshold")
            return cls("relu")
        if threshold is not None:
            if not threshold >= 0:
                raise ValueError(f"threshold must be >= 0, got {threshold}")
            return cls("cats", threshold=threshold)
        s = DEFAULT_SPARSITY if sparsity is None else sparsity
        if not 0.0 <= s < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {s}")
        return cls("cats", target=s)


def gate_preactivations(gate_w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """g = gate . x [n_tokens, n_ff] float32 from the dequantized gate [n_ff, n_embd]."""
    return np.asarray(x, dtype=np.float32) @ gate_w.T


def gate_magnitudes(activation: str, gate_w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|act(gate . x)| [n_tokens, n_ff] float32."""
    return np.abs(activation_values(activation, gate_preactivations(gate_w, x)))


def layer_threshold(plan: SparsityPlan, magnitudes: np.ndarray) -> float:
    if plan.method == "relu":
        return 0.0
    if plan.threshold is not None:
        return float(plan.threshold)
    assert plan.target is not None
    if plan.target == 0.0:
        return 0.0 if magnitudes.min() > 0 else -1.0  # every neuron active: |a| > -1
    return float(np.quantile(magnitudes, plan.target))


def active(magnitudes: np.ndarray, threshold: float) -> np.ndarray:
    return magnitudes > threshold


def ranking(freq: np.ndarray) -> np.ndarray:
    """Neuron indices, most frequently active first (ties: lower index first)."""
    return np.argsort(-freq, kind="stable").astype(np.int32)


def hot_count(freq: np.ndarray) -> int:
    f = np.sort(freq)[::-1]
    total = float(f.sum())
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(f), HOT_SHARE * total) + 1)
