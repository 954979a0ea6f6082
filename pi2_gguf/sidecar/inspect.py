"""`pi2-gguf inspect SIDECAR`: what a sidecar holds, per layer; optionally a PNG of neuron hotness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import MissingExtraError
from ..paths import write_png
from ..runtime import native
from . import format as fmt
from .format import RELU_FAMILY, Key, moe_layer_first
from .reader import Sidecar

HOTNESS_BINS = 1024


def _expert_hotness(kv: dict) -> list[str]:
    """MoE: per routed-expert layer, each expert's share of the layer's tokens on the training text (the router's
    choices)."""
    share = kv.get(Key.MOE_ROUTED_SHARE)
    n = kv.get(Key.MOE_EXPERT_COUNT)
    if share is None or not n:
        return []
    reuse = kv.get(Key.MOE_REUSE)
    first = moe_layer_first(kv.get(Key.MOE_LAYER_EXPERTS), n, len(share))
    rows = [f"experts        share of each layer's tokens routed to each expert (training text), experts 0-{n - 1}"
            + ("; reuse: of a token's routed experts, the share the next token routes to again" if reuse else "") + ":"]
    for il in range(len(first) - 1):
        a, b = first[il], first[il + 1]
        if b - a == 1 and n != 1:
            rows.append(f"  layer {il:3d}   dense FFN (sidecar layer {a})")
            continue
        part = share[a:a + n]
        again = ""
        if reuse:
            w = np.asarray(part, dtype=np.float64)
            again = f", reuse {float(np.dot(w, reuse[a:a + n]) / max(w.sum(), 1e-12)):.2f}"
        shared = f"; shared expert: sidecar layer {a + n}" if b - a == n + 1 else ""
        rows.append(f"  layer {il:3d}   " + " ".join(f"{x:.2f}" for x in part)
                    + f"   (hottest {int(np.argmax(part))}{again}{shared})")
    return rows


def _moe_line(kv: dict, n_layer: int) -> str:
    """How an MoE sidecar's layers map to the model's (FORMAT.md, "MoE sidecars")."""
    n = kv.get(Key.MOE_EXPERT_COUNT)
    if not n:
        return ""
    counts = kv.get(Key.MOE_LAYER_EXPERTS)
    if counts is None:
        return f"; MoE: {n_layer // n} layers of {n} routed experts, sidecar layer = layer * {n} + expert"
    dense = [il for il, c in enumerate(counts) if c == 0]
    shared = sum(1 for c in counts if c == n + 1)
    return (f"; MoE: {len(counts) - len(dense)} layers of {n} routed experts ({shared} with a shared expert) and "
            f"{len(dense)} dense FFN layers{' (' + ', '.join(map(str, dense)) + ')' if dense else ''}, each expert, "
            "shared expert and dense layer one sidecar layer, in model order")


def _disk_line(sc: Sidecar) -> str:
    """What the sidecar adds on disk beside its model, and of what: the neuron bundles (a second copy of the FFN
    weights, laid out neuron by neuron), the predictors, and the rest (rankings, frequencies, header)."""
    model = int(sc.kv[Key.SOURCE_FILE_SIZE])
    size = sc.path.stat().st_size
    by_suffix: dict[str, int] = {}
    for name, t in sc.tensors.items():
        suffix = name.split(".", 2)[-1]
        by_suffix[suffix] = by_suffix.get(suffix, 0) + int(t.n_bytes)
    bundles = by_suffix.get("pi2_bundles", 0)
    predictors = sum(v for k, v in by_suffix.items() if k.startswith("pi2_pred_"))
    copy = int(sc.tensors[fmt.OUTPUT_COPY_TENSOR].n_bytes) if fmt.OUTPUT_COPY_TENSOR in sc.tensors else 0
    return (f"disk           model {model / 1e6:.1f} MB + sidecar {size / 1e6:.1f} MB = {(model + size) / 1e6:.1f} MB "
            f"(the sidecar {100 * size / max(model, 1):.0f}% of the model: neuron bundles {bundles / 1e6:.1f} MB, "
            f"predictors {predictors / 1e6:.1f} MB, "
            + (f"the output matrix's copy {copy / 1e6:.1f} MB, " if copy else "")
            + f"rankings, frequencies and 4 KiB alignment {(size - bundles - predictors - copy) / 1e6:.1f} MB)")


def _copy_type(sc: Sidecar) -> str:
    """The output matrix's copy's type: the stored copy's, else PI2_OUTPUT_COPY's as recorded (a load picks Q4_0 instead
    where a row is not whole 256-value blocks)."""
    if fmt.OUTPUT_COPY_TENSOR in sc.tensors:
        return str(sc.tensors[fmt.OUTPUT_COPY_TENSOR].tensor_type.name)
    return str(sc.kv.get(Key.BUDGET_OUTPUT_COPY, fmt.OUTPUT_COPIES[0])).upper()


def _sparsity_lines(kv: dict, target: float) -> list[str]:
    return [f"sparsity       {kv[Key.SPARSITY_METHOD]}"
            + (f", target {target:.2f}" if target >= 0 else ", fixed threshold")
            + f", held-out density {np.mean(kv[Key.SPARSITY_DENSITY]):.3f} (mean of layers)",
            f"predictors     recall target {kv[Key.PREDICTOR_RECALL_TARGET]:.3f}; held-out recall "
            f"{min(kv[Key.PREDICTOR_RECALL]):.4f} (worst layer), predicted density "
            f"{np.mean(kv[Key.PREDICTOR_DENSITY]):.3f} (mean); W2 held in "
            f"{kv.get(Key.PREDICTOR_W2_TYPE, fmt.PREDICTOR_W2_TYPES[0]).upper()} under a budget"]


def summary(sc: Sidecar) -> str:
    kv = sc.kv
    target = kv[Key.SPARSITY_TARGET]
    sparse = len(sc.whole_layers) < sc.n_layer  # some layer has a plan (thresholds, predictors) of its own
    product = kv[Key.SPARSITY_METHOD] == "product"
    lines = [
        f"sidecar        {sc.path} ({sc.path.stat().st_size / 1e6:.1f} MB), format {kv[Key.FORMAT_VERSION]}",
        f"model          {kv[Key.SOURCE_NAME] or '(unnamed)'} ({kv[Key.SOURCE_ARCHITECTURE]}, "
        f"{kv[Key.SOURCE_FILE_SIZE] / 1e6:.1f} MB), fingerprint {kv[Key.SOURCE_FINGERPRINT]:016x}",
        _disk_line(sc),
        f"FFN            {sc.n_layer} layers, n_embd {kv[Key.N_EMBD]}, activation {kv[Key.ACTIVATION]}"
        + _moe_line(kv, sc.n_layer),
        *_expert_hotness(kv),
        *(_sparsity_lines(kv, target) if sparse else
          ["sparsity       none: every FFN layer is read whole from the model file, computed exactly"]),
        f"calibration    {kv[Key.CALIB_CORPUS]}, {kv[Key.CALIB_TOKENS]} tokens + "
        f"{kv[Key.CALIB_HELDOUT_TOKENS]} held out, {kv[Key.CALIB_DATE]}",
        _quality_line(kv, sparse),
        *(["choice         " + kv[Key.QUALITY_CHOICE]] if Key.QUALITY_CHOICE in kv else []),
        *([f"memory budget  output matrix left in the model file, {kv[Key.BUDGET_OUTPUT_ROWS]} exact rows a token, "
           f"the rest from a {_copy_type(sc)} copy in RAM (PI2_OUTPUT_ROWS, "
           f"PI2_OUTPUT_COPY; the environment or a model setting overrides them)"
           + ("; the copy is stored here (a load reads it)" if fmt.OUTPUT_COPY_TENSOR in sc.tensors else
              "; a load makes the copy (convert again to store it here)")]
          if kv.get(Key.BUDGET_OUTPUT_ROWS) else []),
        "",
        "layer  n_ff  thresh" + (" x up thr" if product else "")
        + "  density  rank  recall  precis  pred.dens   hot  bundle (neurons)  rows  down type (err/tol)  in RAM (cost)",
    ]
    # the plugin's placement rule (docs/BACKEND.md, "Which layers PI2 holds"): in predicted mode a layer is
    # held where sparse decode is estimated faster than ggml-cpu (cost < 1), and always for the ReLU family
    cost = native.sparse_cost_c(sc.path)
    relu_family = kv[Key.ACTIVATION] in RELU_FAMILY
    held = sum(relu_family or c < 1.0 for c in cost)
    lines.insert(-2, f"in RAM         predicted mode holds {held} of {sc.n_layer} FFN layers in PI2; "
                     f"the others run in ggml-cpu's kernels (PI2_LAYERS=auto)")
    whole = sc.whole_layers
    dense_whole = kv.get(Key.DENSE_READS) == "model"
    if dense_whole:
        lines.insert(-2, f"FFN layers     all {sc.n_layer} read whole from the model file under a memory budget "
                         "(pi2.dense_reads = model): no bundles, predictors or rankings here; in RAM they run dense")
    elif whole:
        lines.insert(-2, f"experts        {len(whole)} routed experts read whole from the model file under a memory budget "
                         "(pi2.moe.expert_reads = model): no bundles, predictors or rankings here")
    for il in range(sc.n_layer):
        g = lambda k: kv[k][il]  # noqa: E731
        if il in whole:
            lines.append(f"{il:5d} {g(Key.N_FF):5d}  {'dense FFN' if dense_whole else 'routed expert'}, read whole from the "
                         f"model file "
                         f"({GGMLQuantizationType(g(Key.BUNDLE_GATE_TYPE)).name})")
            continue
        place = "PI2" if relu_family or cost[il] < 1.0 else "cpu"
        lines.append(
            f"{il:5d} {g(Key.N_FF):5d} {g(Key.SPARSITY_THRESHOLDS):7.4f} "
            + (f"{g(Key.SPARSITY_PRODUCT_THRESHOLDS):8.4f} " if product else "") + f"{g(Key.SPARSITY_DENSITY):8.3f} "
            f"{g(Key.PREDICTOR_RANK):5d} {g(Key.PREDICTOR_RECALL):7.4f} {g(Key.PREDICTOR_PRECISION):7.3f} "
            f"{g(Key.PREDICTOR_DENSITY):10.3f} {g(Key.HOT_COUNT):5d} {g(Key.BUNDLE_SIZE):7d} "
            f"({g(Key.BUNDLE_NEURONS):2d})  {GGMLQuantizationType(g(Key.BUNDLE_GATE_TYPE)).name:>4}  "
            f"{GGMLQuantizationType(g(Key.BUNDLE_DOWN_TYPE)).name} "
            f"({g(Key.BUNDLE_DOWN_ERROR):.4f}/{g(Key.BUNDLE_DOWN_TOLERANCE):.4f})  {place} ({cost[il]:.2f})")
    return "\n".join(lines)


def _quality_line(kv: dict, sparse: bool = True) -> str:
    if Key.QUALITY_PERPLEXITY not in kv:
        return "perplexity     not measured (convert --perplexity-budget records it)"
    dense, ppl = float(kv[Key.QUALITY_PERPLEXITY_DENSE]), float(kv[Key.QUALITY_PERPLEXITY])
    how = "predicted, every layer sparse" if sparse else "with the sidecar (its output rows; no sparse layer)"
    return (f"perplexity     {ppl:.3f} {how}, against {dense:.3f} dense "
            f"({ppl / dense - 1:+.1%}; budget +{float(kv[Key.QUALITY_BUDGET]):.1%}) on {kv[Key.QUALITY_TEXT]}")


def hotness(sc: Sidecar, bins: int = HOTNESS_BINS) -> np.ndarray:
    """[n_layer, bins] float32: each layer's neuron activation frequencies in rank order (hottest first),
    averaged into bins (layers may differ in n_ff)."""
    rows = []
    whole = sc.whole_layers
    for il in range(sc.n_layer):
        if il in whole:  # read whole from the model file: no ranking
            rows.append([np.nan] * bins)
            continue
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
    return write_png(fig, path)
