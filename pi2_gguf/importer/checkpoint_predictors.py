"""Activation predictors a checkpoint ships (Bamboo, TurboSparse: `model.layers.N.mlp.predictor.fc1/fc2`,
a relu MLP from the FFN input to one logit per neuron), as candidates for `pi2-gguf convert --checkpoint`.

They have the sidecar predictor's form (h = relu(W1 x + b1), z = W2 h + b2, neuron predicted active iff
z > cutoff; for ReLU-family models the score is z itself, so a logit serves as well as a gate estimate).
convert weighs them per layer against its own by the same measure (bytes read per token at the recall
target, on held-out profiled tokens) and keeps the cheaper."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..converter.predictor import Predictor
from ..errors import CheckpointImportError

_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.predictor\.(fc1|fc2)\.(weight|bias)$")


@dataclass
class CheckpointPredictors:
    layers: dict[int, Predictor] = field(default_factory=dict)
    reason: str = ""  # why there are none (or not for every layer)


def load(hf_dir: str | Path, n_layer: int, n_embd: int, n_ff: int) -> CheckpointPredictors:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointImportError(f"--checkpoint {hf_dir}: not a directory")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        return CheckpointPredictors(reason=f"{hf_dir} has no *.safetensors files")
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointImportError("reading checkpoint predictors needs safetensors and torch: "
                                    "pip install 'pi2-gguf[import]'") from None
    parts: dict[int, dict[str, np.ndarray]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    m = _NAME.match(name)
                    if m:
                        t = st.get_tensor(name).float().numpy()
                        parts.setdefault(int(m.group(1)), {})[f"{m.group(2)}.{m.group(3)}"] = t
        except Exception as e:  # noqa: BLE001 - safetensors and torch raise their own; name the file
            raise CheckpointImportError(f"{f}: not a readable safetensors file ({e})") from e
    if not parts:
        return CheckpointPredictors(reason="the checkpoint ships no mlp.predictor tensors")
    out = CheckpointPredictors()
    bad: list[str] = []
    for il in range(n_layer):
        p = parts.get(il)
        if p is None or "fc1.weight" not in p or "fc2.weight" not in p:
            bad.append(f"layer {il}: no fc1/fc2 weights")
            continue
        w1, w2 = p["fc1.weight"], p["fc2.weight"]
        r = w1.shape[0]
        if w1.shape != (r, n_embd) or w2.shape != (n_ff, r):
            bad.append(f"layer {il}: fc1 {tuple(w1.shape)}, fc2 {tuple(w2.shape)}; the model's FFN needs "
                       f"({r}, {n_embd}) and ({n_ff}, {r})")
            continue
        b1 = p.get("fc1.bias", np.zeros(r, np.float32))
        b2 = p.get("fc2.bias", np.zeros(n_ff, np.float32))
        out.layers[il] = Predictor(w1.astype(np.float32), b1.astype(np.float32), w2.astype(np.float32),
                                   b2.astype(np.float32))
    if bad:
        out.reason = "; ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
    return out
