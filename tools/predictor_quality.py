#!/usr/bin/env python3
"""Predictors of a model, training-free against trained, and how stable its hot neurons are. From a
profile (`pi2-gguf profile MODEL.gguf -o PROFILE.npz`), per layer: the true density on held-out tokens,
and for each predictor kind and rank the predicted density, recall and precision on held-out tokens at
the converter's recall target, with the time each took to fit; then the overlap of the hot neurons (the
top --hot-fraction by firing frequency) between the training tokens and the held-out ones (1.0: the hot set
never moves).

    .venv/bin/python tools/predictor_quality.py MODEL.gguf --profile PROFILE.npz [--ranks 64,128]
        [--kinds svd,trained] [--layers 0,5,11]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pi2_gguf.converter import predictor as pm  # noqa: E402
from pi2_gguf.converter import sparsity as sp  # noqa: E402
from pi2_gguf.converter.model_ffn import ModelFfn, up_values  # noqa: E402
from pi2_gguf.converter.profile import Profile  # noqa: E402
from pi2_gguf.errors import Pi2Error  # noqa: E402
from pi2_gguf.sidecar import format as fmt  # noqa: E402


def hot_overlap(a: np.ndarray, b: np.ndarray, fraction: float) -> float:
    """|top(a) & top(b)| / |top(a)| for the top `fraction` of neurons by firing frequency a and b."""
    k = max(1, int(round(fraction * a.size)))
    ta, tb = set(np.argsort(-a, kind="stable")[:k]), set(np.argsort(-b, kind="stable")[:k])
    return len(ta & tb) / k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--ranks", default="64,128", help="predictor widths, comma-separated")
    ap.add_argument("--kinds", default="svd,trained", help=f"of {', '.join(pm.KINDS)}")
    ap.add_argument("--layers", default="", help="comma-separated (default: first, middle, last)")
    ap.add_argument("--recall", type=float, default=pm.DEFAULT_RECALL)
    ap.add_argument("--hot-fraction", type=float, default=0.02)
    args = ap.parse_args(argv)
    try:
        model = ModelFfn(args.model)
        prof = Profile.load(args.profile)
        prof.check_model(model.path)
    except Pi2Error as e:
        print(f"predictor_quality: error: {e}", file=sys.stderr)
        return 2
    if model.activation not in fmt.RELU_FAMILY:
        print(f"predictor_quality: error: {model.activation} model; this tool measures ReLU-family models", file=sys.stderr)
        return 2
    ranks = [int(r) for r in args.ranks.split(",")]
    kinds = args.kinds.split(",")
    if any(k not in pm.KINDS for k in kinds):
        ap.error(f"--kinds takes {', '.join(pm.KINDS)}")
    n = model.n_layer
    layers = [int(v) for v in args.layers.split(",")] if args.layers else sorted({0, n // 2, n - 1})
    score = pm.score_fn("relu", model.act)
    print(f"{model.path.name}: {model.activation}, recall target {args.recall}")
    print("layer | density | kind | rank | predicted density | recall | precision | fit s | hot overlap train/held-out")
    print("---|---|---|---|---|---|---|---|---")
    for il in layers:
        ffn = model.layers[il]
        gate = ffn["gate"].dequantized()
        xt, xh = prof.train[il].astype(np.float32), prof.heldout[il].astype(np.float32)
        gt, gh = sp.gate_preactivations(gate, xt), sp.gate_preactivations(gate, xh)
        th = model.activation_threshold
        yt, yh = gt > th, gh > th
        if model.activation == "drelu":
            up = ffn["up"].dequantized()
            yt &= up_values("drelu", xt @ up.T) > 0
            yh &= up_values("drelu", xh @ up.T) > 0
        overlap = hot_overlap((gt > th).mean(0), (gh > th).mean(0), args.hot_fraction)
        costs = pm.Costs(3 * fmt.row_size(ffn["gate"].qtype, model.n_embd))
        for kind in kinds:
            for r in ranks:
                t0 = time.time()
                f = pm.fit_layer(score, th, gate, xt, gt, xh, gh, [r], args.recall, costs, y_train=yt, y_held=yh, kind=kind)
                q = f.heldout
                print(f"{il} | {yh.mean():.3f} | {kind} | {r} | {q.density:.3f} | {q.recall:.3f} | {q.precision:.3f} | "
                      f"{time.time() - t0:.1f} | {overlap:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
