"""Neuron bundles (docs/FORMAT.md, "Bundle layout"): gate row, up row and down column of one neuron (or
of a few neurons in a row), padded to a multiple of pi2.bundle.align (4 KiB unless asked). Gate/up rows are copied byte for
byte (or, with convert --bundle-type, re-quantized to that type);
down columns are dequantized, transposed and quantized again with ggml's own quantizer (libggml-base
ggml_quantize_chunk, which covers every type, K-quants included), in the smallest type that keeps the
model type's own error."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from ..runtime import ggml_base
from ..sidecar import format as fmt
from .model_ffn import FfnTensor

TOLERANCE_SLACK = 1.05
# columns a smaller type is tried on before all of them, fewest first: most smaller types fail, and the slow ones
# (IQ4_NL, IQ4_XS: 1.6 s for a Qwen2.5-1.5B layer's 8,960 columns) already on the fewest
SAMPLE_COLUMNS = (128, 1024)
# types ggml quantizes without an importance matrix, considered for down columns
CANDIDATES = (QT.Q2_K, QT.Q3_K, QT.IQ4_XS, QT.Q4_0, QT.IQ4_NL, QT.Q4_K, QT.Q4_1, QT.Q5_0, QT.Q5_K, QT.Q5_1,
              QT.Q6_K, QT.Q8_0, QT.BF16, QT.F16, QT.F32)


def bits_per_weight(t: QT) -> float:
    block, nbytes = GGML_QUANT_SIZES[t]
    return 8.0 * nbytes / block


def fits(t: QT, n: int) -> bool:
    return n % GGML_QUANT_SIZES[t][0] == 0


def quantize_rows(t: QT, rows: np.ndarray) -> np.ndarray:
    """[n, k] float32 -> [n, row_size(t, k)] uint8, as ggml quantizes (rows split over the cores: ctypes
    releases the GIL while ggml_quantize_chunk runs)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, k = rows.shape
    rs = fmt.row_size(t, k)
    out = np.empty((n, rs), dtype=np.uint8)
    lib = ggml_base.lib()
    if lib.ggml_quantize_requires_imatrix(int(t)):
        raise ValueError(f"{t.name} needs an importance matrix")
    parts = max(1, min(os.cpu_count() or 1, n // 256))
    bounds = np.linspace(0, n, parts + 1).astype(int)

    def chunk(i: int) -> int:
        r0, r1 = int(bounds[i]), int(bounds[i + 1])
        # start is an element index of src; dst is written from start / k rows on
        return lib.ggml_quantize_chunk(int(t), rows.ctypes.data, out.ctypes.data, r0 * k, r1 - r0, k, None)

    with ThreadPoolExecutor(parts) as pool:
        written = sum(pool.map(chunk, range(parts)))
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {t.name}, expected {out.nbytes}")
    return out


def dequantize_rows(t: QT, data: np.ndarray, k: int) -> np.ndarray:
    return ggml_base.to_float(int(t), data, data.size // fmt.row_size(t, k) * k).reshape(-1, k)


def rel_rmse(q: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Per row |q - c| / |c| (0 for an all-zero c)."""
    num = np.linalg.norm(q - c, axis=1)
    den = np.linalg.norm(c, axis=1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), num)


@dataclass(frozen=True)
class DownColumns:
    qtype: QT
    data: np.ndarray      # [n_ff, row_size(qtype, n_embd)] uint8, neuron order
    tolerance: float
    max_error: float
    tried: tuple[tuple[str, float], ...]  # (type, largest rel_rmse)


def reference_type(src: QT, n_embd: int) -> QT:
    """The model's down type, or if a row of n_embd cannot be that type, the smallest type of at least
    its bits per weight that fits."""
    if fits(src, n_embd) and src in CANDIDATES:
        return src
    ok = [t for t in CANDIDATES if fits(t, n_embd) and bits_per_weight(t) >= bits_per_weight(src)]
    if not ok:
        raise ValueError(f"no quantization type fits a down column of {n_embd} values")
    return min(ok, key=bits_per_weight)


def check_bundle_type(t: QT, n_embd: int) -> None:
    """A type gate/up rows and down columns may be stored in (convert --bundle-type): one ggml quantizes
    without an importance matrix, whose blocks divide a row of n_embd."""
    if t not in CANDIDATES:
        names = ", ".join(c.name.lower() for c in CANDIDATES)
        raise ValueError(f"bundle type {t.name.lower()} is not one ggml quantizes without an importance matrix "
                         f"({names})")
    if not fits(t, n_embd):
        raise ValueError(f"bundle type {t.name.lower()} has blocks of {GGML_QUANT_SIZES[t][0]} values, which do not "
                         f"divide this model's rows of n_embd = {n_embd}")


def bundle_rows(t: FfnTensor, qtype: QT) -> np.ndarray:
    """Rows of ffn_gate or ffn_up as bundles store them: the model's bytes, or re-quantized to qtype."""
    if qtype == t.qtype:
        return t.raw
    return quantize_rows(qtype, t.dequantized())


def down_columns(down: FfnTensor, reference: QT | None = None) -> DownColumns:
    """Transposes and re-quantizes ffn_down [n_embd rows of n_ff] into n_ff columns of n_embd. reference: the
    type whose error sets the tolerance (default: the model's down type; convert --bundle-type gives its own)."""
    cols = np.ascontiguousarray(down.dequantized().T)  # [n_ff, n_embd]
    n_embd = cols.shape[1]
    ref = reference_type(down.qtype, n_embd) if reference is None else reference
    results: dict[QT, tuple[float, np.ndarray]] = {}

    # a type whose error on a sample of columns already exceeds the tolerance fails on all of them (the rule takes the
    # largest error): only types that pass every sample are quantized whole
    samples = [cols[:: cols.shape[0] // k] for k in SAMPLE_COLUMNS if cols.shape[0] // k > 1]

    def attempt(t: QT, tol: float | None = None) -> float:
        if tol is not None:
            for sample in samples:
                err = float(rel_rmse(dequantize_rows(t, quantize_rows(t, sample), n_embd), sample).max())
                if err > tol:
                    return err
        q = quantize_rows(t, cols)
        err = float(rel_rmse(dequantize_rows(t, q, n_embd), cols).max())
        results[t] = (err, q)
        return err

    tol = attempt(ref) * TOLERANCE_SLACK
    chosen = ref
    # smaller types, one bits-per-weight level at a time from the largest down: error grows as bits
    # shrink, so the walk stops at the first level where no type stays within the tolerance
    smaller = [t for t in CANDIDATES if fits(t, n_embd) and bits_per_weight(t) < bits_per_weight(ref)]
    for level in sorted({bits_per_weight(t) for t in smaller}, reverse=True):
        passing = [t for t in smaller if bits_per_weight(t) == level and attempt(t, tol) <= tol]
        if not passing:
            break
        chosen = min(passing, key=lambda t: results[t][0])
    err, data = results[chosen]
    return DownColumns(chosen, data, tol, err, tuple((t.name, e) for t, (e, _) in results.items()))


def layer_bundles(gate: np.ndarray, up: np.ndarray, down: DownColumns, order: np.ndarray,
                  layout: fmt.BundleLayout) -> np.ndarray:
    """[n_bundles, bundle size] uint8: bundle slot j (neuron order[j]) at layout.offset(j). gate, up: the rows
    as bundles store them (bundle_rows), [n_ff, row bytes] uint8."""
    n_ff, n_bundles = len(order), layout.n_bundles(len(order))
    # every slot of every bundle as a row of `stride` bytes (slots past n_ff stay zero)
    rows = np.zeros((n_bundles * layout.neurons, layout.stride), dtype=np.uint8)
    rows[:n_ff, :layout.up_offset] = gate[order]
    rows[:n_ff, layout.up_offset:layout.down_offset] = up[order]
    rows[:n_ff, layout.down_offset:layout.end] = down.data[order]
    out = np.zeros((n_bundles, layout.size), dtype=np.uint8)
    out[:, :layout.neurons * layout.stride] = rows.reshape(n_bundles, -1)
    return out
