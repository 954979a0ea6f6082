"""`pi2-gguf inspect SIDECAR`: what a sidecar holds, per layer; optionally a PNG of neuron hotness."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from .. import png
from .reader import Sidecar, read

PNG_WIDTH = 1024
ROW_HEIGHT = 8


def summary(sc: Sidecar) -> str:
    kv = sc.kv
    target = kv["pi2.sparsity.target"]
    product = kv["pi2.sparsity.method"] == "product"
    lines = [
        f"sidecar        {sc.path} ({sc.path.stat().st_size / 1e6:.1f} MB), format {kv['pi2.format_version']}",
        f"model          {kv['pi2.source.name'] or '(unnamed)'} ({kv['pi2.source.architecture']}, "
        f"{kv['pi2.source.file_size'] / 1e6:.1f} MB), fingerprint {kv['pi2.source.fingerprint']:016x}",
        f"FFN            {sc.n_layer} layers, n_embd {kv['pi2.n_embd']}, activation {kv['pi2.activation']}",
        f"sparsity       {kv['pi2.sparsity.method']}"
        + (f", target {target:.2f}" if target >= 0 else ", fixed threshold")
        + f", held-out density {np.mean(kv['pi2.sparsity.density']):.3f} (mean of layers)",
        f"predictors     recall target {kv['pi2.predictor.recall_target']:.3f}; held-out recall "
        f"{min(kv['pi2.predictor.recall']):.4f} (worst layer), predicted density "
        f"{np.mean(kv['pi2.predictor.density']):.3f} (mean)",
        f"calibration    {kv['pi2.calib.corpus']}, {kv['pi2.calib.tokens']} tokens + "
        f"{kv['pi2.calib.heldout_tokens']} held out, {kv['pi2.calib.date']}",
        "",
        "layer  n_ff  thresh" + (" x up thr" if product else "")
        + "  density  rank  recall  precis  pred.dens   hot  bundle (neurons)  down type (err/tol)",
    ]
    for il in range(sc.n_layer):
        g = lambda k: kv[k][il]  # noqa: E731
        lines.append(
            f"{il:5d} {g('pi2.n_ff'):5d} {g('pi2.sparsity.thresholds'):7.4f} "
            + (f"{g('pi2.sparsity.product_thresholds'):8.4f} " if product else "") + f"{g('pi2.sparsity.density'):8.3f} "
            f"{g('pi2.predictor.rank'):5d} {g('pi2.predictor.recall'):7.4f} {g('pi2.predictor.precision'):7.3f} "
            f"{g('pi2.predictor.density'):10.3f} {g('pi2.hot_count'):5d} {g('pi2.bundle.size'):7d} ({g('pi2.bundle.neurons'):2d})  "
            f"{GGMLQuantizationType(g('pi2.bundle.down_type')).name} "
            f"({g('pi2.bundle.down_error'):.4f}/{g('pi2.bundle.down_tolerance'):.4f})")
    return "\n".join(lines)


def hotness_image(sc: Sidecar, width: int = PNG_WIDTH, row_height: int = ROW_HEIGHT) -> np.ndarray:
    """One band per layer; x = neurons in rank order (hottest left), colour = activation frequency."""
    rows = []
    for il in range(sc.n_layer):
        freq = sc.layer_tensor(il, "pi2_freq").astype(np.float32).reshape(-1)
        ranked = freq[sc.layer_tensor(il, "pi2_order").reshape(-1)]
        edges = np.linspace(0, ranked.size, width + 1).astype(np.int64)
        binned = np.array([ranked[a:max(b, a + 1)].mean() for a, b in zip(edges[:-1], edges[1:])], np.float32)
        rows.append(np.repeat(png.colormap(binned)[None, :, :], row_height, axis=0))
    return np.concatenate(rows, axis=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pi2-gguf inspect", description="Summarize a pi2 sidecar GGUF.")
    ap.add_argument("sidecar", type=Path)
    ap.add_argument("--png", type=Path, help="save a heat map of neuron activation frequency per layer")
    args = ap.parse_args(argv)
    sc = read(args.sidecar)
    print(summary(sc))
    if args.png:
        png.write_rgb(args.png, hotness_image(sc))
        print(f"\nhotness map: {args.png} (rows = layers 0..{sc.n_layer - 1} top to bottom, x = neurons hottest "
              "first, colour = share of tokens on which the neuron fired, dark 0 to yellow 1)")
    return 0
