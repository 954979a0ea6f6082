"""`pi2-gguf inspect SIDECAR`: what a sidecar holds, per layer; optionally a PNG of neuron hotness."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import MissingExtraError, OutputWriteError
from ..paths import check_output
from ..runtime import native
from .format import RELU_FAMILY
from .reader import Sidecar

HOTNESS_BINS = 1024


def _expert_hotness(kv: dict) -> list[str]:
    """MoE: per layer, each expert's share of the layer's tokens on the training text (the router's choices)."""
    share = kv.get("pi2.moe.routed_share")
    n = kv.get("pi2.moe.expert_count")
    if share is None or not n:
        return []
    reuse = kv.get("pi2.moe.reuse")
    rows = [f"experts        share of each layer's tokens routed to each expert (training text), experts 0-{n - 1}"
            + ("; reuse: of a token's routed experts, the share the next token routes to again" if reuse else "") + ":"]
    for il in range(len(share) // n):
        part = share[il * n:(il + 1) * n]
        again = ""
        if reuse:
            w = np.asarray(part, dtype=np.float64)
            again = f", reuse {float(np.dot(w, reuse[il * n:(il + 1) * n]) / max(w.sum(), 1e-12)):.2f}"
        rows.append(f"  layer {il:3d}   " + " ".join(f"{x:.2f}" for x in part) + f"   (hottest {int(np.argmax(part))}{again})")
    return rows


def summary(sc: Sidecar) -> str:
    kv = sc.kv
    target = kv["pi2.sparsity.target"]
    product = kv["pi2.sparsity.method"] == "product"
    lines = [
        f"sidecar        {sc.path} ({sc.path.stat().st_size / 1e6:.1f} MB), format {kv['pi2.format_version']}",
        f"model          {kv['pi2.source.name'] or '(unnamed)'} ({kv['pi2.source.architecture']}, "
        f"{kv['pi2.source.file_size'] / 1e6:.1f} MB), fingerprint {kv['pi2.source.fingerprint']:016x}",
        f"FFN            {sc.n_layer} layers, n_embd {kv['pi2.n_embd']}, activation {kv['pi2.activation']}"
        + (f"; MoE: {sc.n_layer // kv['pi2.moe.expert_count']} layers of {kv['pi2.moe.expert_count']} routed experts, "
           f"sidecar layer = layer * {kv['pi2.moe.expert_count']} + expert" if "pi2.moe.expert_count" in kv else ""),
        *_expert_hotness(kv),
        f"sparsity       {kv['pi2.sparsity.method']}"
        + (f", target {target:.2f}" if target >= 0 else ", fixed threshold")
        + f", held-out density {np.mean(kv['pi2.sparsity.density']):.3f} (mean of layers)",
        f"predictors     recall target {kv['pi2.predictor.recall_target']:.3f}; held-out recall "
        f"{min(kv['pi2.predictor.recall']):.4f} (worst layer), predicted density "
        f"{np.mean(kv['pi2.predictor.density']):.3f} (mean)",
        f"calibration    {kv['pi2.calib.corpus']}, {kv['pi2.calib.tokens']} tokens + "
        f"{kv['pi2.calib.heldout_tokens']} held out, {kv['pi2.calib.date']}",
        _quality_line(kv),
        *(["choice         " + kv["pi2.quality.choice"]] if "pi2.quality.choice" in kv else []),
        *([f"memory budget  output matrix left in the model file, {kv['pi2.budget.output_rows']} exact rows a token, "
           f"the rest from a {kv.get('pi2.budget.output_copy', 'q3_k').upper()} copy in RAM (PI2_OUTPUT_ROWS, "
           f"PI2_OUTPUT_COPY; the environment or a model setting overrides them)"]
          if kv.get("pi2.budget.output_rows") else []),
        "",
        "layer  n_ff  thresh" + (" x up thr" if product else "")
        + "  density  rank  recall  precis  pred.dens   hot  bundle (neurons)  rows  down type (err/tol)  in RAM (cost)",
    ]
    # the plugin's placement rule (docs/BACKEND.md, "Which layers PI2 holds"): in predicted mode a layer is
    # held where sparse decode is estimated faster than ggml-cpu (cost < 1), and always for the ReLU family
    cost = native.sparse_cost_c(sc.path)
    relu_family = kv["pi2.activation"] in RELU_FAMILY
    held = sum(relu_family or c < 1.0 for c in cost)
    lines.insert(-2, f"in RAM         predicted mode holds {held} of {sc.n_layer} FFN layers in PI2; "
                     f"the others run in ggml-cpu's kernels (PI2_LAYERS=auto)")
    for il in range(sc.n_layer):
        g = lambda k: kv[k][il]  # noqa: E731
        place = "PI2" if relu_family or cost[il] < 1.0 else "cpu"
        lines.append(
            f"{il:5d} {g('pi2.n_ff'):5d} {g('pi2.sparsity.thresholds'):7.4f} "
            + (f"{g('pi2.sparsity.product_thresholds'):8.4f} " if product else "") + f"{g('pi2.sparsity.density'):8.3f} "
            f"{g('pi2.predictor.rank'):5d} {g('pi2.predictor.recall'):7.4f} {g('pi2.predictor.precision'):7.3f} "
            f"{g('pi2.predictor.density'):10.3f} {g('pi2.hot_count'):5d} {g('pi2.bundle.size'):7d} ({g('pi2.bundle.neurons'):2d})  "
            f"{GGMLQuantizationType(g('pi2.bundle.gate_type')).name:>4}  {GGMLQuantizationType(g('pi2.bundle.down_type')).name} "
            f"({g('pi2.bundle.down_error'):.4f}/{g('pi2.bundle.down_tolerance'):.4f})  {place} ({cost[il]:.2f})")
    return "\n".join(lines)


def _quality_line(kv: dict) -> str:
    if "pi2.quality.perplexity" not in kv:
        return "perplexity     not measured (convert --perplexity-budget records it)"
    dense, ppl = float(kv["pi2.quality.perplexity_dense"]), float(kv["pi2.quality.perplexity"])
    return (f"perplexity     {ppl:.3f} predicted, every layer sparse, against {dense:.3f} dense "
            f"({ppl / dense - 1:+.1%}; budget +{float(kv['pi2.quality.budget']):.1%}) on {kv['pi2.quality.text']}")


def hotness(sc: Sidecar, bins: int = HOTNESS_BINS) -> np.ndarray:
    """[n_layer, bins] float32: each layer's neuron activation frequencies in rank order (hottest first),
    averaged into bins (layers may differ in n_ff)."""
    rows = []
    for il in range(sc.n_layer):
        freq = sc.layer_tensor(il, "pi2_freq").astype(np.float32).reshape(-1)
        ranked = freq[sc.layer_tensor(il, "pi2_order").reshape(-1)]
        edges = np.linspace(0, ranked.size, bins + 1).astype(np.int64)
        rows.append([ranked[a:max(b, a + 1)].mean() for a, b in zip(edges[:-1], edges[1:], strict=True)])
    return np.asarray(rows, dtype=np.float32)


def save_hotness_png(sc: Sidecar, path: str | Path) -> Path:
    """A heat map of hotness(): one row per layer (layer 0 on top), colour = share of tokens on which the
    neuron fired. Needs matplotlib (the `plot` extra); written atomically."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingExtraError("the hotness map needs matplotlib: pip install 'pi2-gguf[plot]'") from e
    heat = hotness(sc)
    fig = Figure(figsize=(10, 1.5 + 0.12 * sc.n_layer), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(heat, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0,
                   extent=(0.0, 1.0, sc.n_layer - 0.5, -0.5))
    ax.set_xlabel("neurons in rank order, hottest first (share of the layer's neurons)")
    ax.set_ylabel("layer")
    ax.set_title(f"{sc.path.name}: neuron hotness")
    fig.colorbar(im, ax=ax, label="share of tokens the neuron fired on")
    out = check_output(path, "--png")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        tmp.replace(out)
    except OSError as e:
        raise OutputWriteError(f"cannot write --png {out}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return out
