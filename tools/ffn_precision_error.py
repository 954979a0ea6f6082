#!/usr/bin/env python3
"""What storing cold neurons at a lower precision would cost, per FFN layer, before any sidecar holds them.

For each layer, the held-out FFN inputs of a profile (`pi2-gguf profile`) go through the layer's FFN with the model's
weights (the reference) and with every neuron outside the top fraction h rounded through TYPE (gate and up rows,
and the down column, each as ggml quantizes a row). Neurons are ranked by activation energy, mean(a^2) * |down
column|^2 over the profile's training inputs: the share of the layer's output each carries. Prints the mean relative
error of the layer's output for each h, and the energy share of the top third.

    tools/ffn_precision_error.py qwen.gguf qwen.npz --type q3_k --layers 0,3,8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pi2_gguf.converter import bundles  # noqa: E402
from pi2_gguf.converter.model_ffn import ModelFfn  # noqa: E402
from pi2_gguf.converter.profile import Profile  # noqa: E402

HOT_FRACTIONS = (0.0, 0.25, 1 / 3, 0.5)


def rounded(t: QT, rows: np.ndarray) -> np.ndarray:
    return bundles.dequantize_rows(t, bundles.quantize_rows(t, rows), rows.shape[1])


def layer_errors(model: ModelFfn, prof: Profile, il: int, t: QT, n_eval: int, n_rank: int) -> tuple[list[float], float]:
    ffn = model.layers[il]
    x = prof.heldout[il][:n_eval].astype(np.float32)
    xr = prof.train[il][:n_rank].astype(np.float32)
    g, u = ffn["gate"].dequantized(), ffn["up"].dequantized()  # [n_ff, n_embd]
    d = ffn["down"].dequantized()  # [n_embd, n_ff]
    gq, uq, dq = rounded(t, g), rounded(t, u), rounded(t, np.ascontiguousarray(d.T)).T
    y = (model.act(x @ g.T) * (x @ u.T)) @ d.T
    a = model.act(xr @ g.T) * (xr @ u.T)
    energy = (a**2).mean(0) * (d**2).sum(0)
    rank = np.argsort(-energy)
    norm = np.linalg.norm(y, axis=1)
    errors = []
    for h in HOT_FRACTIONS:
        hot = rank[: int(h * len(rank))]
        G, U, D = gq.copy(), uq.copy(), dq.copy()
        G[hot], U[hot], D[:, hot] = g[hot], u[hot], d[:, hot]
        yq = (model.act(x @ G.T) * (x @ U.T)) @ D.T
        errors.append(float(np.mean(np.linalg.norm(yq - y, axis=1) / norm)))
    share = np.sort(energy)[::-1].cumsum() / energy.sum()
    return errors, float(share[len(share) // 3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("profile", type=Path, help="the model's profile (pi2-gguf profile MODEL -o PROFILE.npz)")
    ap.add_argument("--type", default="q3_k", help="the lower precision (a ggml type quantized without an imatrix)")
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    ap.add_argument("--tokens", type=int, default=512, help="held-out FFN inputs a layer is measured on")
    ap.add_argument("--rank-tokens", type=int, default=2048, help="training FFN inputs the neurons are ranked on")
    args = ap.parse_args(argv)
    if args.type.upper() not in QT.__members__:
        ap.error(f"--type {args.type}: not a ggml type")
    t = QT[args.type.upper()]
    try:
        model = ModelFfn(args.model)
        layers = range(model.n_layer) if args.layers is None else [int(v) for v in args.layers.split(",")]
        prof = Profile.load(args.profile)
        if (prof.n_layer, prof.n_embd) != (model.n_layer, model.n_embd):
            raise ValueError(f"{args.profile}: the profile was made for a model of {prof.n_layer} layers of {prof.n_embd}, "
                             f"not {args.model} ({model.n_layer} of {model.n_embd})")
        if any(il < 0 or il >= model.n_layer for il in layers):
            raise ValueError(f"--layers: {args.model} has layers 0..{model.n_layer - 1}")
        bundles.check_bundle_type(t, model.n_embd)
    except (KeyError, ValueError, OSError) as e:
        ap.error(str(e))
    print(f"| layer (down type) | {' | '.join(f'h {h:.2f}' for h in HOT_FRACTIONS)} | energy in the top 1/3 | s |")
    print("|---" * (len(HOT_FRACTIONS) + 3) + "|")
    for il in layers:
        t0 = time.time()
        errors, share = layer_errors(model, prof, il, t, args.tokens, args.rank_tokens)
        down = model.layers[il]["down"].qtype.name
        print(f"| {il} ({down}) | {' | '.join(f'{e:.3f}' for e in errors)} | {share:.0%} | {time.time() - t0:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
