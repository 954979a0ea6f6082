#!/usr/bin/env python3
"""How far can a predictor skip gate rows on this model? A bound, from the model and a profile.

Sparse decode saves a neuron's gate row only if something cheaper than the gate predicts the neuron
inactive. This tool scores every neuron with low-bit copies of the layer's own gate and up matrices (k
bits per weight, symmetric, per group of 32: the most informed predictor that costs k/4.5 of Q4_K's
bytes; the up copy only for the product criterion, which needs up), sets the cutoff on the profile's training tokens for each recall target, and reports on its
held-out tokens the share of neurons such a predictor must select. If even 3-bit copies must select
most neurons, no cheaper predictor will skip many gate rows at that sparsity, and decode cannot gain
much over dense there (every gate row is computed).

    .venv/bin/python tools/gate_predictability.py MODEL.gguf --profile PROFILE.npz
        [--sparsity 0.5] [--criterion product|act] [--layers 5,14,22] [--bits 1,2,3] [--tokens 3000]

A profile comes from `pi2-gguf profile MODEL.gguf -o PROFILE.npz` (convert takes the same one: --profile).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pi2_gguf.converter import sparsity as sp
from pi2_gguf.converter.model_ffn import ModelFfn, activation_values
from pi2_gguf.converter.predictor import cutoff_for_recall
from pi2_gguf.converter.profile import Profile
from pi2_gguf.errors import Pi2Error
from pi2_gguf.sidecar import format as fmt

GROUP = 32
RECALLS = (0.99, 0.95, 0.90)


def low_bit_copy(w: np.ndarray, bits: int) -> np.ndarray:
    """w [rows, k] rounded to 2**bits symmetric levels per group of GROUP (1 bit: sign x mean |w|)."""
    rows, k = w.shape
    g = w.reshape(rows, k // GROUP, GROUP)
    if bits == 1:
        q = np.where(g >= 0, 1.0, -1.0) * np.abs(g).mean(axis=2, keepdims=True)
    else:
        half = 2 ** (bits - 1) - 0.5  # levels +-0.5 .. +-half, in units of max|w| / half
        m = np.abs(g).max(axis=2, keepdims=True) + 1e-30
        q = np.clip(np.floor(g / m * half) + 0.5, -half, half) * (m / half)
    return q.reshape(rows, k).astype(np.float32)


def copy_row_bytes(bits: int, n_embd: int) -> float:
    """Bytes of one row of a low-bit copy: the levels and an f16 scale per group."""
    return n_embd * bits / 8 + 2 * n_embd / GROUP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--profile", type=Path, required=True, help="a profile of this model (.npz)")
    ap.add_argument("--sparsity", type=float, default=sp.DEFAULT_SPARSITY)
    ap.add_argument("--criterion", choices=sp.CRITERIA, default=sp.DEFAULT_CRITERION)
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: 3 spread out)")
    ap.add_argument("--bits", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=3000, help="training tokens to use (cutoffs)")
    args = ap.parse_args(argv)
    try:
        model = ModelFfn(args.model)
        prof = Profile.load(args.profile)
        prof.check_model(model.path)
        plan = sp.SparsityPlan.for_activation(model.activation, None if model.activation in fmt.RELU_FAMILY
                                              else args.sparsity, None,
                                              None if model.activation in fmt.RELU_FAMILY else args.criterion)
    except (Pi2Error, ValueError, OSError) as e:
        print(f"gate_predictability: {e}", file=sys.stderr)
        return 2
    n = model.n_layer
    layers = ([int(s) for s in args.layers.split(",")] if args.layers else sorted({n // 5, n // 2, (4 * n) // 5}))
    if any(not 0 <= il < n for il in layers):
        print(f"gate_predictability: layers must be in 0..{n - 1}", file=sys.stderr)
        return 2
    bits_list = [int(b) for b in args.bits.split(",")]
    if any(not 1 <= b <= 8 for b in bits_list) or model.n_embd % GROUP:
        print(f"gate_predictability: bits must be 1..8 and n_embd a multiple of {GROUP}", file=sys.stderr)
        return 2
    act = lambda g: activation_values(model.activation, g)  # noqa: E731
    # selected[bits][recall] and achieved recall, per layer
    selected = {b: {r: [] for r in RECALLS} for b in bits_list}
    achieved = {b: {r: [] for r in RECALLS} for b in bits_list}
    density: list[float] = []
    copy_share = {b: [] for b in bits_list}
    for il in tqdm(layers, desc="layers", unit="layer"):
        ffn = model.layers[il]
        gate_w, up_w = ffn["gate"].dequantized(), ffn["up"].dequantized()
        x_tr = prof.train[il][: args.tokens].astype(np.float32)
        x_he = prof.heldout[il].astype(np.float32)

        def truth(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            a = act(sp.gate_preactivations(gate_w, x))
            return np.abs(a), np.abs(a * (x @ up_w.T))

        mag_tr, prod_tr = truth(x_tr)
        mag_he, prod_he = truth(x_he)
        if plan.method == "product":
            th, tp = sp.product_thresholds(plan, mag_tr, prod_tr)
            y_tr, y_he = sp.active(mag_tr, th, prod_tr, tp), sp.active(mag_he, th, prod_he, tp)
        else:
            th = sp.layer_threshold(plan, mag_tr)
            y_tr, y_he = sp.active(mag_tr, th), sp.active(mag_he, th)
        density.append(float(y_he.mean()))
        row_bytes = fmt.row_size(ffn["gate"].qtype, model.n_embd) + fmt.row_size(ffn["up"].qtype, model.n_embd)
        product = plan.method == "product"
        for b in bits_list:
            gq = low_bit_copy(gate_w, b)
            uq = low_bit_copy(up_w, b) if product else None

            def score(x: np.ndarray) -> np.ndarray:
                a = act(x @ gq.T)
                if uq is not None:
                    return np.abs(a * (x @ uq.T))
                return a if plan.method == "relu" else np.abs(a)

            s_tr, s_he = score(x_tr), score(x_he)
            copy_share[b].append((1 + product) * copy_row_bytes(b, model.n_embd) / row_bytes)
            for r in RECALLS:
                pred = s_he > cutoff_for_recall(s_tr, y_tr, r)
                selected[b][r].append(float(pred.mean()))
                achieved[b][r].append(float((pred & y_he).sum() / max(int(y_he.sum()), 1)))
    method = plan.method if plan.method == "relu" else f"{plan.method} at {args.sparsity:.0%} sparsity"
    print(f"{model.path.name}: {method}; layers {','.join(map(str, layers))}; held-out active share "
          f"{np.mean(density):.3f}; {min(args.tokens, prof.n_train)} training tokens, {prof.n_heldout} held out")
    print(f"| predictor ({'gate and up copies' if plan.method == 'product' else 'gate copy'}) | bytes vs gate+up rows | " +
          " | ".join(f"selects at recall {r:.2f} (held-out recall)" for r in RECALLS) + " |")
    print("|---|---|" + "---|" * len(RECALLS))
    for b in bits_list:
        cells = [f"{np.mean(selected[b][r]):.3f} ({np.mean(achieved[b][r]):.3f})" for r in RECALLS]
        print(f"| {b}-bit | {np.mean(copy_share[b]):.2f}x | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
