"""Writing the pi2 sidecar GGUF (docs/FORMAT.md) with gguf-py."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from ..errors import OutputWriteError
from . import format as fmt
from .format import Key


@dataclass
class LayerData:
    """Everything the sidecar holds for one layer; bundles come from a callback at write time so a
    large model's bundles never sit in memory together."""

    n_ff: int
    threshold: float
    density: float
    rank: int
    cutoff: float
    recall: float
    precision: float
    predicted_density: float
    hot_count: int
    bundle_size: int
    gate_type: int
    up_type: int
    down_type: int
    down_tolerance: float
    down_error: float
    w1: np.ndarray     # [r, n_embd] float16
    b1: np.ndarray     # [r] float32
    w2: np.ndarray     # [n_ff, r] float16
    b2: np.ndarray     # [n_ff] float32
    freq: np.ndarray   # [n_ff] float32
    order: np.ndarray  # [n_ff] int32
    product_threshold: float = 0.0  # method "product" only
    bundle_neurons: int = 1

    @property
    def n_bundles(self) -> int:
        return -(-self.n_ff // self.bundle_neurons)

    @classmethod
    def whole(cls, n_ff: int, gate_type: int, up_type: int, down_type: int) -> LayerData:
        """A routed expert or a dense FFN layer read whole from the model file (pi2.moe.expert_reads or pi2.dense_reads
        = model): its size and types, and
        placeholders for what it does not have (no predictor, bundles or ranking; density 1: every neuron)."""
        empty = np.zeros(0, np.float32)
        return cls(n_ff=n_ff, threshold=0.0, density=1.0, rank=0, cutoff=0.0, recall=1.0, precision=1.0,
                   predicted_density=1.0, hot_count=0, bundle_size=0, gate_type=gate_type, up_type=up_type,
                   down_type=down_type, down_tolerance=0.0, down_error=0.0, w1=empty, b1=empty, w2=empty, b2=empty,
                   freq=empty, order=np.zeros(0, np.int32))


@dataclass(frozen=True)
class Quality:
    """Perplexity measured on held-out text when the sidecar was made (FORMAT.md, optional keys)."""
    text: str
    perplexity_dense: float
    perplexity: float
    budget: float  # the relative increase the configuration was chosen for
    choice: str = ""  # what convert chose within the budget, and why (one line)


@dataclass
class SidecarMeta:
    source_architecture: str
    source_name: str
    source_file_size: int
    tensor_fingerprints: list[int]
    n_embd: int
    activation: str
    activation_threshold: float  # FATReLU's t; 0 for the other activations
    method: str
    target: float
    recall_target: float
    corpus: str
    corpus_sha256: str
    tokens: int
    heldout_tokens: int
    date: str
    layers: list[LayerData] = field(default_factory=list)
    bundle_align: int = fmt.BUNDLE_ALIGN
    quality: Quality | None = None  # the optional pi2.quality.* keys
    output_rows: int | None = None  # pi2.budget.output_rows: PI2_OUTPUT_ROWS under a memory budget (None: not recorded)
    output_copy: str | None = None  # pi2.budget.output_copy: PI2_OUTPUT_COPY under a memory budget (None: not recorded)
    n_expert: int = 0  # pi2.moe.expert_count: an MoE model's experts a layer (its layers are (layer, expert)); 0: dense
    routed_share: list[float] | None = None  # pi2.moe.routed_share: per (layer, expert), its share of the layer's tokens
    reuse: list[float] | None = None  # pi2.moe.reuse: per (layer, expert), of its tokens the share whose next is too
    # pi2.moe.layer_experts: per model layer 0 (a dense FFN, one layer here) or n_expert; None: every layer routed
    layer_experts: list[int] | None = None
    # pi2.moe.expert_reads: "model" where routed experts are read whole from the model file (their layers LayerData.whole,
    # no tensors); None or "bundles": from the sidecar's bundles
    expert_reads: str | None = None
    # pi2.dense_reads: "model" where a dense model's FFN layers are read whole from the model file (every layer
    # LayerData.whole); None or "bundles": from the sidecar's bundles
    dense_reads: str | None = None
    # pi2.predictor.w2_type: the type decode holds the predictors' W2 in, which their cutoffs were calibrated with
    # (None: not recorded, q8_0)
    predictor_w2_type: str | None = None

    @property
    def whole_layers(self) -> frozenset[int]:
        if self.dense_reads == "model":
            return frozenset(range(len(self.layers)))
        if self.expert_reads != "model":
            return frozenset()
        return frozenset(fmt.routed_layers(self.layer_experts, self.n_expert, len(self.layers)))


@dataclass(frozen=True)
class OutputCopy:
    """The output matrix's in-RAM copy a memory budget computes every logit from (FORMAT.md, output.pi2_copy), as the
    plugin's load quantizes it (native.output_copy)."""
    qtype: int  # a ggml type of fmt.OPTIONAL_TENSORS' output.pi2_copy
    rows: np.ndarray  # [n_vocab, row bytes] uint8


def _f32(v: Any) -> float:
    """v as the f32 the file holds: a value past f32's range is +-inf (a random model's perplexity can be
    exp(100); struct.pack refuses it), not an OverflowError after the whole conversion ran."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


_ADD: dict[fmt.KT, Callable[[GGUFWriter, str, Any], None]] = {
    fmt.KT.U32: lambda w, k, v: w.add_uint32(k, int(v)),
    fmt.KT.U64: lambda w, k, v: w.add_uint64(k, int(v)),
    fmt.KT.F32: lambda w, k, v: w.add_float32(k, _f32(v)),
    fmt.KT.STR: lambda w, k, v: w.add_string(k, str(v)),
    fmt.KT.U32_ARR: lambda w, k, v: w.add_key_value(k, [int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.UINT32),
    fmt.KT.U64_ARR: lambda w, k, v: w.add_key_value(k, [int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    fmt.KT.F32_ARR: lambda w, k, v: w.add_key_value(k, [_f32(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
}


# per-layer keys and the LayerData field each comes from
_PER_LAYER = {
    Key.N_FF: "n_ff", Key.SPARSITY_THRESHOLDS: "threshold", Key.SPARSITY_DENSITY: "density",
    Key.PREDICTOR_RANK: "rank", Key.PREDICTOR_CUTOFF: "cutoff", Key.PREDICTOR_RECALL: "recall",
    Key.PREDICTOR_PRECISION: "precision", Key.PREDICTOR_DENSITY: "predicted_density",
    Key.HOT_COUNT: "hot_count", Key.BUNDLE_SIZE: "bundle_size", Key.BUNDLE_NEURONS: "bundle_neurons",
    Key.BUNDLE_GATE_TYPE: "gate_type",
    Key.BUNDLE_UP_TYPE: "up_type", Key.BUNDLE_DOWN_TYPE: "down_type",
    Key.BUNDLE_DOWN_TOLERANCE: "down_tolerance", Key.BUNDLE_DOWN_ERROR: "down_error",
    Key.SPARSITY_PRODUCT_THRESHOLDS: "product_threshold",
}


def _key_values(m: SidecarMeta) -> dict[str, Any]:
    kv: dict[str, Any] = {
        Key.FORMAT_VERSION: fmt.FORMAT_VERSION,
        Key.SOURCE_ARCHITECTURE: m.source_architecture,
        Key.SOURCE_NAME: m.source_name,
        Key.SOURCE_FILE_SIZE: m.source_file_size,
        Key.SOURCE_FINGERPRINT: fmt.model_fingerprint(m.tensor_fingerprints),
        Key.SOURCE_TENSOR_FINGERPRINTS: m.tensor_fingerprints,
        Key.N_LAYER: len(m.layers),
        Key.N_EMBD: m.n_embd,
        Key.ACTIVATION: m.activation,
        Key.ACTIVATION_THRESHOLD: m.activation_threshold,
        Key.SPARSITY_METHOD: m.method,
        Key.SPARSITY_TARGET: m.target,
        Key.PREDICTOR_RECALL_TARGET: m.recall_target,
        Key.CALIB_CORPUS: m.corpus,
        Key.CALIB_CORPUS_SHA256: m.corpus_sha256,
        Key.CALIB_TOKENS: m.tokens,
        Key.CALIB_HELDOUT_TOKENS: m.heldout_tokens,
        Key.CALIB_DATE: m.date,
        Key.BUNDLE_ALIGN: m.bundle_align,
    }
    for key, attr in _PER_LAYER.items():
        if key in fmt.keys_of(m.method):
            kv[key] = [getattr(ld, attr) for ld in m.layers]
    if m.quality is not None:
        kv.update({Key.QUALITY_TEXT: m.quality.text, Key.QUALITY_PERPLEXITY_DENSE: m.quality.perplexity_dense,
                   Key.QUALITY_PERPLEXITY: m.quality.perplexity, Key.QUALITY_BUDGET: m.quality.budget})
        if m.quality.choice:
            kv[Key.QUALITY_CHOICE] = m.quality.choice
    if m.n_expert:
        fmt.moe_layer_first(m.layer_experts, m.n_expert, len(m.layers))  # ValueError unless it describes the layers
        kv[Key.MOE_EXPERT_COUNT] = m.n_expert
        if m.layer_experts is not None:
            kv[Key.MOE_LAYER_EXPERTS] = m.layer_experts
        if m.routed_share is not None:
            if len(m.routed_share) != len(m.layers):
                raise ValueError(f"{len(m.routed_share)} routed shares for {len(m.layers)} layers")
            kv[Key.MOE_ROUTED_SHARE] = m.routed_share
        if m.reuse is not None:
            if len(m.reuse) != len(m.layers):
                raise ValueError(f"{len(m.reuse)} reuse shares for {len(m.layers)} layers")
            kv[Key.MOE_REUSE] = m.reuse
        if m.expert_reads is not None:
            if m.expert_reads not in fmt.EXPERT_READS:
                raise ValueError(f"expert reads {m.expert_reads!r} is not one of {', '.join(fmt.EXPERT_READS)}")
            kv[Key.MOE_EXPERT_READS] = m.expert_reads
    elif m.expert_reads is not None:
        raise ValueError("expert reads are a setting of an MoE sidecar, and this one has no experts")
    if m.dense_reads is not None:
        if m.n_expert:
            raise ValueError("dense reads are a setting of a dense model's sidecar, and this one has experts")
        if m.dense_reads not in fmt.DENSE_READS:
            raise ValueError(f"dense reads {m.dense_reads!r} is not one of {', '.join(fmt.DENSE_READS)}")
        kv[Key.DENSE_READS] = m.dense_reads
    if m.predictor_w2_type is not None:
        if m.predictor_w2_type not in fmt.PREDICTOR_W2_TYPES:
            raise ValueError(f"predictor W2 type {m.predictor_w2_type!r} is not one of {', '.join(fmt.PREDICTOR_W2_TYPES)}")
        kv[Key.PREDICTOR_W2_TYPE] = m.predictor_w2_type
    if m.output_rows is not None:
        if not 0 <= m.output_rows <= fmt.MAX_OUTPUT_ROWS:
            raise ValueError(f"output rows {m.output_rows} is not 0 to {fmt.MAX_OUTPUT_ROWS}")
        kv[Key.BUDGET_OUTPUT_ROWS] = m.output_rows
    if m.output_copy is not None:
        if m.output_copy not in fmt.OUTPUT_COPIES:
            raise ValueError(f"output copy {m.output_copy!r} is not one of {', '.join(fmt.OUTPUT_COPIES)}")
        kv[Key.BUDGET_OUTPUT_COPY] = m.output_copy
    return kv


def _small_tensors(il: int, ld: LayerData) -> list[tuple[str, np.ndarray]]:
    return [
        (fmt.tensor_name(il, "pi2_pred_w1"), np.ascontiguousarray(ld.w1, dtype=np.float16)),
        (fmt.tensor_name(il, "pi2_pred_b1"), np.ascontiguousarray(ld.b1, dtype=np.float32)),
        (fmt.tensor_name(il, "pi2_pred_w2"), np.ascontiguousarray(ld.w2, dtype=np.float16)),
        (fmt.tensor_name(il, "pi2_pred_b2"), np.ascontiguousarray(ld.b2, dtype=np.float32)),
        (fmt.tensor_name(il, "pi2_freq"), np.ascontiguousarray(ld.freq, dtype=np.float32)),
        (fmt.tensor_name(il, "pi2_order"), np.ascontiguousarray(ld.order, dtype=np.int32)),
    ]


def write_failure(e: OSError, tmp: Path) -> str:
    """Why a write failed. numpy's tofile reports a short write without errno ("N requested and M written"):
    the file system it went to is then said to be full when it has no block left."""
    if e.strerror:
        return e.strerror
    try:
        full = os.statvfs(tmp.parent).f_bavail == 0
    except OSError:
        full = False
    return f"No space left on device ({e})" if full else str(e)


def write(path: str | Path, meta: SidecarMeta, bundles: Callable[[int], np.ndarray],
          progress: Callable[[int], None] | None = None, output_copy: OutputCopy | None = None) -> Path:
    """Writes the sidecar atomically (temp file beside it, then rename). bundles(layer) returns that
    layer's [n_bundles, bundle size] uint8 array; output_copy, where given, is written as output.pi2_copy (a sidecar
    that records output rows)."""
    out = Path(path)
    kv = _key_values(meta)
    if output_copy is not None:
        types, _ = fmt.OPTIONAL_TENSORS[fmt.OUTPUT_COPY_TENSOR]
        qt = GGMLQuantizationType(output_copy.qtype)
        rows = output_copy.rows
        if (qt.name not in types or rows.dtype != np.uint8 or rows.ndim != 2
                or rows.shape[1] != fmt.row_size(qt, meta.n_embd)):
            raise ValueError(f"output copy {qt.name} {rows.dtype} {rows.shape} is not {', '.join(types)} rows of "
                             f"n_embd = {meta.n_embd}")
        if not meta.output_rows:
            raise ValueError("an output copy belongs to a sidecar that records output rows")
    required = set(kv) - set(fmt.OPTIONAL_KEYS)
    if required != set(fmt.keys_of(meta.method)):
        raise AssertionError(f"writer keys differ from the format: {sorted(required ^ set(fmt.keys_of(meta.method)))}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        w = GGUFWriter(tmp, fmt.ARCHITECTURE)
    except OSError as e:
        raise OutputWriteError(f"cannot write sidecar {out}: {e.strerror or e}") from e
    try:
        w.add_custom_alignment(fmt.BUNDLE_ALIGN)
        for k, v in kv.items():
            _ADD[fmt.KEYS.get(k) or fmt.OPTIONAL_KEYS[k]](w, k, v)
        order: list[tuple[int, str, np.ndarray | None]] = []
        whole = meta.whole_layers
        for il, ld in enumerate(meta.layers):
            if il in whole:
                continue  # read whole from the model file: nothing here
            for name, arr in _small_tensors(il, ld):
                w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes)
                order.append((il, name, arr))
            name = fmt.tensor_name(il, "pi2_bundles")
            shape = (ld.n_bundles, ld.bundle_size)
            w.add_tensor_info(name, shape, np.dtype(np.int8), ld.n_bundles * ld.bundle_size)
            order.append((il, name, None))
        if output_copy is not None:
            w.add_tensor_info(fmt.OUTPUT_COPY_TENSOR, output_copy.rows.shape, output_copy.rows.dtype,
                              output_copy.rows.nbytes, raw_dtype=GGMLQuantizationType(output_copy.qtype))
            order.append((-1, fmt.OUTPUT_COPY_TENSOR, output_copy.rows))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for il, name, data in order:
            if data is None:
                b = bundles(il)
                ld = meta.layers[il]
                if b.shape != (ld.n_bundles, ld.bundle_size) or b.dtype != np.uint8:
                    raise AssertionError(f"bundles of layer {il}: {b.shape} {b.dtype}")
                w.write_tensor_data(b.view(np.int8))
                if progress:
                    progress(il)
            else:
                w.write_tensor_data(data)
        w.close()
        tmp.replace(out)
    except OSError as e:  # ENOSPC, EIO, EDQUOT...: the temp file goes (finally), the old output stays
        raise OutputWriteError(f"cannot write sidecar {out}: {write_failure(e, tmp)}") from e
    finally:
        if w.fout is not None:
            w.close()
        tmp.unlink(missing_ok=True)
    return out
