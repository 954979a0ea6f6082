"""Names, types and layout rules of the pi2 sidecar GGUF, declared once (spec: docs/FORMAT.md).

tests/test_format.py checks these declarations, and the C reader's, against docs/FORMAT.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

FORMAT_VERSION = 4
ARCHITECTURE = "pi2"
BUNDLE_ALIGN = 4096  # general.alignment, and the default and largest pi2.bundle.align
# pi2.bundle.align may be any of these: a bundle can be read with O_DIRECT where the device's logical block
# divides it (512 on most disks and on this VM; 4096 on UFS flash), and smaller units waste less padding
BUNDLE_ALIGNS = (512, 1024, 2048, 4096)
# within a bundle of several neurons each neuron starts on this many bytes (as GGUF tensor data does)
NEURON_ALIGN = 32
MAX_BUNDLE_NEURONS = 16
SUFFIX = ".pi2.gguf"


class KT(Enum):
    """Value types of sidecar keys ("[]" = one element per layer, or 3 per layer for fingerprints)."""

    U32 = "u32"
    U64 = "u64"
    F32 = "f32"
    STR = "string"
    U32_ARR = "u32[]"
    U64_ARR = "u64[]"
    F32_ARR = "f32[]"


class Key:
    """The sidecar's key names, each written once: the C header's PI2_KEY_* macros without the prefix
    (ggml-backend/src/sidecar_format.h). KEYS, OPTIONAL_KEYS and METHOD_KEYS below give their types."""

    FORMAT_VERSION = "pi2.format_version"
    SOURCE_ARCHITECTURE = "pi2.source.architecture"
    SOURCE_NAME = "pi2.source.name"
    SOURCE_FILE_SIZE = "pi2.source.file_size"
    SOURCE_FINGERPRINT = "pi2.source.fingerprint"
    SOURCE_TENSOR_FINGERPRINTS = "pi2.source.tensor_fingerprints"
    N_LAYER = "pi2.n_layer"
    N_EMBD = "pi2.n_embd"
    N_FF = "pi2.n_ff"
    ACTIVATION = "pi2.activation"
    ACTIVATION_THRESHOLD = "pi2.activation_threshold"
    SPARSITY_METHOD = "pi2.sparsity.method"
    SPARSITY_TARGET = "pi2.sparsity.target"
    SPARSITY_THRESHOLDS = "pi2.sparsity.thresholds"
    SPARSITY_PRODUCT_THRESHOLDS = "pi2.sparsity.product_thresholds"
    SPARSITY_DENSITY = "pi2.sparsity.density"
    PREDICTOR_RANK = "pi2.predictor.rank"
    PREDICTOR_CUTOFF = "pi2.predictor.cutoff"
    PREDICTOR_RECALL_TARGET = "pi2.predictor.recall_target"
    PREDICTOR_RECALL = "pi2.predictor.recall"
    PREDICTOR_PRECISION = "pi2.predictor.precision"
    PREDICTOR_DENSITY = "pi2.predictor.density"
    HOT_COUNT = "pi2.hot_count"
    CALIB_CORPUS = "pi2.calib.corpus"
    CALIB_CORPUS_SHA256 = "pi2.calib.corpus_sha256"
    CALIB_TOKENS = "pi2.calib.tokens"
    CALIB_HELDOUT_TOKENS = "pi2.calib.heldout_tokens"
    CALIB_DATE = "pi2.calib.date"
    BUNDLE_ALIGN = "pi2.bundle.align"
    BUNDLE_SIZE = "pi2.bundle.size"
    BUNDLE_NEURONS = "pi2.bundle.neurons"
    BUNDLE_GATE_TYPE = "pi2.bundle.gate_type"
    BUNDLE_UP_TYPE = "pi2.bundle.up_type"
    BUNDLE_DOWN_TYPE = "pi2.bundle.down_type"
    BUNDLE_DOWN_TOLERANCE = "pi2.bundle.down_tolerance"
    BUNDLE_DOWN_ERROR = "pi2.bundle.down_error"
    # optional (FORMAT.md, "Optional keys")
    QUALITY_TEXT = "pi2.quality.text"
    QUALITY_PERPLEXITY_DENSE = "pi2.quality.perplexity_dense"
    QUALITY_PERPLEXITY = "pi2.quality.perplexity"
    QUALITY_BUDGET = "pi2.quality.budget"
    QUALITY_CHOICE = "pi2.quality.choice"
    BUDGET_OUTPUT_ROWS = "pi2.budget.output_rows"
    BUDGET_OUTPUT_COPY = "pi2.budget.output_copy"
    MOE_EXPERT_COUNT = "pi2.moe.expert_count"
    MOE_ROUTED_SHARE = "pi2.moe.routed_share"
    MOE_REUSE = "pi2.moe.reuse"
    MOE_LAYER_EXPERTS = "pi2.moe.layer_experts"
    MOE_EXPERT_READS = "pi2.moe.expert_reads"
    DENSE_READS = "pi2.dense_reads"
    PREDICTOR_W2_TYPE = "pi2.predictor.w2_type"


KEYS: dict[str, KT] = {
    Key.FORMAT_VERSION: KT.U32,
    Key.SOURCE_ARCHITECTURE: KT.STR,
    Key.SOURCE_NAME: KT.STR,
    Key.SOURCE_FILE_SIZE: KT.U64,
    Key.SOURCE_FINGERPRINT: KT.U64,
    Key.SOURCE_TENSOR_FINGERPRINTS: KT.U64_ARR,
    Key.N_LAYER: KT.U32,
    Key.N_EMBD: KT.U32,
    Key.N_FF: KT.U32_ARR,
    Key.ACTIVATION: KT.STR,
    Key.ACTIVATION_THRESHOLD: KT.F32,
    Key.SPARSITY_METHOD: KT.STR,
    Key.SPARSITY_TARGET: KT.F32,
    Key.SPARSITY_THRESHOLDS: KT.F32_ARR,
    Key.SPARSITY_PRODUCT_THRESHOLDS: KT.F32_ARR,
    Key.SPARSITY_DENSITY: KT.F32_ARR,
    Key.PREDICTOR_RANK: KT.U32_ARR,
    Key.PREDICTOR_CUTOFF: KT.F32_ARR,
    Key.PREDICTOR_RECALL_TARGET: KT.F32,
    Key.PREDICTOR_RECALL: KT.F32_ARR,
    Key.PREDICTOR_PRECISION: KT.F32_ARR,
    Key.PREDICTOR_DENSITY: KT.F32_ARR,
    Key.HOT_COUNT: KT.U32_ARR,
    Key.CALIB_CORPUS: KT.STR,
    Key.CALIB_CORPUS_SHA256: KT.STR,
    Key.CALIB_TOKENS: KT.U64,
    Key.CALIB_HELDOUT_TOKENS: KT.U64,
    Key.CALIB_DATE: KT.STR,
    Key.BUNDLE_ALIGN: KT.U32,
    Key.BUNDLE_SIZE: KT.U32_ARR,
    Key.BUNDLE_NEURONS: KT.U32_ARR,
    Key.BUNDLE_GATE_TYPE: KT.U32_ARR,
    Key.BUNDLE_UP_TYPE: KT.U32_ARR,
    Key.BUNDLE_DOWN_TYPE: KT.U32_ARR,
    Key.BUNDLE_DOWN_TOLERANCE: KT.F32_ARR,
    Key.BUNDLE_DOWN_ERROR: KT.F32_ARR,
}

# keys a sidecar may hold (FORMAT.md, "Optional keys"); readers of the required ones ignore them
OPTIONAL_KEYS: dict[str, KT] = {
    Key.QUALITY_TEXT: KT.STR,
    Key.QUALITY_PERPLEXITY_DENSE: KT.F32,
    Key.QUALITY_PERPLEXITY: KT.F32,
    Key.QUALITY_BUDGET: KT.F32,
    Key.QUALITY_CHOICE: KT.STR,
    Key.BUDGET_OUTPUT_ROWS: KT.U32,
    Key.BUDGET_OUTPUT_COPY: KT.STR,
    Key.MOE_EXPERT_COUNT: KT.U32,
    Key.MOE_ROUTED_SHARE: KT.F32_ARR,
    Key.MOE_REUSE: KT.F32_ARR,
    Key.MOE_LAYER_EXPERTS: KT.U32_ARR,
    Key.MOE_EXPERT_READS: KT.STR,
    Key.DENSE_READS: KT.STR,
    Key.PREDICTOR_W2_TYPE: KT.STR,
}

# pi2.moe.expert_reads: where a memory budget reads routed experts from, the sidecar's neuron bundles or the model file
# (whole experts; the sidecar then holds no bundles, predictor or ranking for them)
EXPERT_READS = ("bundles", "model")
# pi2.dense_reads: the same for a dense model's FFN layers (its values are EXPERT_READS')
DENSE_READS = EXPERT_READS


def moe_layer_first(layer_experts: list[int] | None, n_expert: int, n_layer: int) -> list[int]:
    """An MoE sidecar's first sidecar layer of each model layer, and n_layer after the last (FORMAT.md, "MoE
    sidecars"): layer_experts is pi2.moe.layer_experts (None: every model layer has n_expert routed experts alone).
    ValueError naming the problem, in the C reader's words, where the keys do not describe n_layer sidecar layers."""
    if n_expert <= 0 or (layer_experts is None and n_layer % n_expert):
        raise ValueError(f"key {Key.MOE_EXPERT_COUNT} is {n_expert}, which does not divide its {n_layer} layers")
    counts = [n_expert] * (n_layer // n_expert) if layer_experts is None else list(layer_experts)
    first = [0]
    for il, c in enumerate(counts):
        if c not in (0, n_expert, n_expert + 1):
            raise ValueError(f"key {Key.MOE_LAYER_EXPERTS}[{il}] is {c}, not 0 (a dense FFN layer), {Key.MOE_EXPERT_COUNT} "
                             f"{n_expert} (routed experts) or one more (and a shared expert)")
        first.append(first[-1] + max(c, 1))
    routed = any(counts)
    if first[-1] != n_layer or not routed:
        raise ValueError(f"key {Key.MOE_LAYER_EXPERTS} describes {first[-1]} sidecar layers"
                         f"{'' if routed else ' and no routed layer'}, not its {n_layer}")
    return first


def routed_layers(layer_experts: list[int] | None, n_expert: int, n_layer: int) -> list[int]:
    """The sidecar layers that are routed experts (not a dense FFN layer or a shared expert), ascending."""
    counts = [n_expert] * (n_layer // n_expert) if layer_experts is None else list(layer_experts)
    first = moe_layer_first(layer_experts, n_expert, n_layer)
    return [v for il, c in enumerate(counts) if c for v in range(first[il], first[il] + n_expert)]


# pi2.predictor.w2_type: the type decode holds a predictor's W2 in (absent: the first, as before the key)
PREDICTOR_W2_TYPES = ("q8_0", "q4_0")
DEFAULT_PREDICTOR_W2_TYPE = "q4_0"  # what convert writes


def predictor_decode_types(n_embd: int, n_ff: int, rank: int, w2_type: str = PREDICTOR_W2_TYPES[0]) \
        -> tuple[GGMLQuantizationType, GGMLQuantizationType]:
    """The types the plugin holds a predictor's W1 (rank rows of n_embd) and W2 (rank rows of n_ff, in bundle-slot
    order) in (sparse/predictor.c): Q8_0, and w2_type for W2, where the rows are whole blocks of 32, else F16."""
    q = GGMLQuantizationType
    w1 = q.Q8_0 if n_embd % 32 == 0 and rank % 32 == 0 else q.F16
    w2 = (q.Q4_0 if w2_type == "q4_0" else q.Q8_0) if n_ff % 32 == 0 else q.F16
    return w1, w2


# the largest pi2.budget.output_rows: PI2_OUTPUT_ROWS's range (ggml-backend/src/config.c)
MAX_OUTPUT_ROWS = 4096
# pi2.budget.output_copy's values: PI2_OUTPUT_COPY's (ggml-backend/src/config.c)
OUTPUT_COPIES = ("q3_k", "q2_k")

# per-layer tensors: suffix -> (ggml type name, shape in ggml order with symbolic dims)
TENSORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pi2_pred_w1": ("F16", ("n_embd", "r")),
    "pi2_pred_b1": ("F32", ("r",)),
    "pi2_pred_w2": ("F16", ("r", "n_ff")),
    "pi2_pred_b2": ("F32", ("n_ff",)),
    "pi2_freq": ("F32", ("n_ff",)),
    "pi2_order": ("I32", ("n_ff",)),
    "pi2_bundles": ("I8", ("bundle size", "n_bundles")),
}

# the optional tensor (FORMAT.md, "Optional tensor"): name -> (the ggml types it may have, shape in ggml order): the
# output matrix's in-RAM copy under pi2.budget.output_rows, as the plugin's load would quantize it
OUTPUT_COPY_TENSOR = "output.pi2_copy"
OPTIONAL_TENSORS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    OUTPUT_COPY_TENSOR: (("Q3_K", "Q2_K", "Q4_0"), ("n_embd", "n_vocab")),
}

ACTIVATIONS = ("silu", "gelu", "gelu_erf", "relu", "drelu", "fatrelu", "swiglu_oai")
RELU_FAMILY = ("relu", "drelu", "fatrelu")
SPARSITY_METHODS = ("cats", "product", "relu")
# keys only a sidecar of one method holds
METHOD_KEYS: dict[str, str] = {Key.SPARSITY_PRODUCT_THRESHOLDS: "product"}


def keys_of(method: str) -> dict[str, KT]:
    """The keys a sidecar of this sparsity method holds."""
    return {k: t for k, t in KEYS.items() if METHOD_KEYS.get(k, method) == method}


def tensor_name(layer: int, suffix: str) -> str:
    if suffix not in TENSORS:
        raise KeyError(f"not a sidecar tensor: {suffix}")
    return f"blk.{layer}.{suffix}"


def sidecar_path_for(model: str | Path) -> Path:
    """The default sidecar of a model: MODEL.gguf -> MODEL.pi2.gguf beside it."""
    p = Path(model)
    name = p.name[:-5] if p.name.endswith(".gguf") else p.name
    return p.with_name(name + SUFFIX)


def row_size(qtype: int | GGMLQuantizationType, n: int) -> int:
    """ggml_row_size: bytes of n values of qtype (n must be a multiple of the block size)."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if n % block:
        raise ValueError(f"{n} values are not a whole number of {GGMLQuantizationType(qtype).name} blocks of {block}")
    return n // block * nbytes


def check_bundle_align(align: int) -> None:
    """ValueError unless align may be a sidecar's pi2.bundle.align."""
    if align not in BUNDLE_ALIGNS:
        raise ValueError(f"{Key.BUNDLE_ALIGN} is {align}, not one of {', '.join(map(str, BUNDLE_ALIGNS))}")


def check_bundle_neurons(neurons: int) -> None:
    """ValueError unless a bundle may hold this many neurons."""
    if not 1 <= neurons <= MAX_BUNDLE_NEURONS:
        raise ValueError(f"{Key.BUNDLE_NEURONS} is {neurons}, not 1..{MAX_BUNDLE_NEURONS}")


@dataclass(frozen=True)
class BundleLayout:
    """Where a layer's neurons sit in its bundles (docs/FORMAT.md, "Bundle layout")."""

    up_offset: int    # a neuron's parts: gate row at 0, up row here, down column at down_offset
    down_offset: int
    end: int          # end of a neuron's parts
    stride: int       # from one neuron of a bundle to the next
    neurons: int      # neurons per bundle
    size: int         # bytes per bundle, a multiple of the alignment

    def n_bundles(self, n_ff: int) -> int:
        return -(-n_ff // self.neurons)

    def offset(self, slot: int) -> int:
        """Byte offset of bundle slot `slot` (a neuron) from the layer's first bundle."""
        return slot // self.neurons * self.size + slot % self.neurons * self.stride


def bundle_layout(gate_type: int, up_type: int, down_type: int, n_embd: int, align: int = BUNDLE_ALIGN,
                  neurons: int = 1, size: int | None = None) -> BundleLayout:
    """The layout of bundles of `neurons` neurons each: `size` bytes, by default the neurons' bytes rounded up
    to a multiple of align."""
    check_bundle_align(align)
    check_bundle_neurons(neurons)
    up_off = row_size(gate_type, n_embd)
    down_off = up_off + row_size(up_type, n_embd)
    end = down_off + row_size(down_type, n_embd)
    stride = -(-end // NEURON_ALIGN) * NEURON_ALIGN
    tight = -(-(neurons * stride) // align) * align
    if size is None:
        size = tight
    elif size % align or size < neurons * stride:
        raise ValueError(f"bundle size {size} does not hold its {neurons} x {stride} bytes of data or is not a "
                         f"multiple of {Key.BUNDLE_ALIGN} = {align}")
    return BundleLayout(up_off, down_off, end, stride, neurons, size)


def packed_bundle_layouts(layer_types: list[tuple[int, int, int]], n_embd: int,
                          align: int = BUNDLE_ALIGN) -> list[BundleLayout]:
    """Layouts for layers that pack several neurons to a bundle (gate, up and down type per layer): one
    bundle size for all of them, the one that pads least per neuron over the layers (smallest on ties),
    each layer holding as many neurons (1..MAX_BUNDLE_NEURONS) as fit. One size because the neuron cache's
    cold entries are all as large as the largest bundle, and only bundles that fill their entries lie
    back to back in memory, where one iovec reads a run of them: Qwen2.5-1.5B's Q4_K and Q6_K layers,
    2,592 and 3,008 bytes a neuron, get 14 and 12 neurons in 36,352 bytes (0.5% padding), where 16 and 8
    to a bundle (41,472 and 24,064 bytes, each the tightest alone) left the Q6_K layers' entries 42% empty."""
    kinds = sorted(set(layer_types))
    strides = {t: bundle_layout(*t, n_embd, align).stride for t in kinds}
    count = {t: layer_types.count(t) for t in kinds}
    best: tuple[float, int] | None = None
    for size in sorted({bundle_layout(*t, n_embd, align, g).size for t in kinds for g in range(1, MAX_BUNDLE_NEURONS + 1)}):
        fit = {t: min(MAX_BUNDLE_NEURONS, size // strides[t]) for t in kinds}
        if min(fit.values()) == 0:
            continue
        waste = sum(count[t] * (size / fit[t] - strides[t]) for t in kinds)
        if best is None or (waste, size) < best:
            best = (waste, size)
    if best is None:
        raise ValueError("no bundle size fits one neuron of every layer")
    size = best[1]
    return [bundle_layout(*t, n_embd, align, min(MAX_BUNDLE_NEURONS, size // strides[t]), size) for t in layer_types]


# --- fingerprint -------------------------------------------------------------------------------

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
FP_SAMPLES = 16
FP_SAMPLE_BYTES = 256


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def _fingerprint_bytes(qtype: int, ne0: int, ne1: int, data: np.ndarray) -> bytes:
    """What a tensor's fingerprint hashes: the header, then FP_SAMPLES samples of the raw bytes."""
    raw = data.reshape(-1).view(np.uint8)
    nbytes = raw.size
    s = min(FP_SAMPLE_BYTES, nbytes)
    head = (int(qtype).to_bytes(4, "little") + ne0.to_bytes(8, "little") + ne1.to_bytes(8, "little")
            + nbytes.to_bytes(8, "little"))
    return head + b"".join(raw[k * (nbytes - s) // (FP_SAMPLES - 1):][:s].tobytes() for k in range(FP_SAMPLES))


def tensor_fingerprint(qtype: int, ne0: int, ne1: int, data: np.ndarray) -> int:
    """Fingerprint of one FFN weight tensor from its raw bytes (docs/FORMAT.md, "Fingerprint")."""
    return fnv1a64(_fingerprint_bytes(qtype, ne0, ne1, data))


def tensor_fingerprints(tensors: list[tuple[int, int, int, np.ndarray]]) -> list[int]:
    """tensor_fingerprint of each (qtype, ne0, ne1, data), many at once: the hashes of equally long inputs advance a
    byte at a time together (numpy's uint64 arithmetic wraps mod 2^64 as the hash's does). An MoE model has tens
    of thousands of expert matrices: one at a time in Python took 75 s on a Qwen3-30B-A3B-shaped model."""
    msgs = [_fingerprint_bytes(*t) for t in tensors]
    out = [0] * len(msgs)
    by_len: dict[int, list[int]] = {}
    for i, m in enumerate(msgs):
        by_len.setdefault(len(m), []).append(i)
    prime = np.uint64(FNV_PRIME)
    for n, idx in by_len.items():
        rows = np.frombuffer(b"".join(msgs[i] for i in idx), np.uint8).reshape(len(idx), n)
        h = np.full(len(idx), FNV_OFFSET, np.uint64)
        with np.errstate(over="ignore"):
            for col in rows.T.astype(np.uint64):
                h ^= col
                h *= prime
        for i, v in zip(idx, h.tolist()):
            out[i] = int(v)
    return out


def model_fingerprint(tensor_fps: list[int]) -> int:
    return fnv1a64(b"".join(int(f).to_bytes(8, "little") for f in tensor_fps))
