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

FORMAT_VERSION = 2
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


KEYS: dict[str, KT] = {
    "pi2.format_version": KT.U32,
    "pi2.source.architecture": KT.STR,
    "pi2.source.name": KT.STR,
    "pi2.source.file_size": KT.U64,
    "pi2.source.fingerprint": KT.U64,
    "pi2.source.tensor_fingerprints": KT.U64_ARR,
    "pi2.n_layer": KT.U32,
    "pi2.n_embd": KT.U32,
    "pi2.n_ff": KT.U32_ARR,
    "pi2.activation": KT.STR,
    "pi2.sparsity.method": KT.STR,
    "pi2.sparsity.target": KT.F32,
    "pi2.sparsity.thresholds": KT.F32_ARR,
    "pi2.sparsity.product_thresholds": KT.F32_ARR,
    "pi2.sparsity.density": KT.F32_ARR,
    "pi2.predictor.rank": KT.U32_ARR,
    "pi2.predictor.cutoff": KT.F32_ARR,
    "pi2.predictor.recall_target": KT.F32,
    "pi2.predictor.recall": KT.F32_ARR,
    "pi2.predictor.precision": KT.F32_ARR,
    "pi2.predictor.density": KT.F32_ARR,
    "pi2.hot_count": KT.U32_ARR,
    "pi2.calib.corpus": KT.STR,
    "pi2.calib.corpus_sha256": KT.STR,
    "pi2.calib.tokens": KT.U64,
    "pi2.calib.heldout_tokens": KT.U64,
    "pi2.calib.date": KT.STR,
    "pi2.bundle.align": KT.U32,
    "pi2.bundle.size": KT.U32_ARR,
    "pi2.bundle.neurons": KT.U32_ARR,
    "pi2.bundle.gate_type": KT.U32_ARR,
    "pi2.bundle.up_type": KT.U32_ARR,
    "pi2.bundle.down_type": KT.U32_ARR,
    "pi2.bundle.down_tolerance": KT.F32_ARR,
    "pi2.bundle.down_error": KT.F32_ARR,
}

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

ACTIVATIONS = ("silu", "gelu", "gelu_erf", "relu", "drelu")
RELU_FAMILY = ("relu", "drelu")
SPARSITY_METHODS = ("cats", "product", "relu")
# keys only a sidecar of one method holds
METHOD_KEYS: dict[str, str] = {"pi2.sparsity.product_thresholds": "product"}


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
        raise ValueError(f"pi2.bundle.align is {align}, not one of {', '.join(map(str, BUNDLE_ALIGNS))}")


def check_bundle_neurons(neurons: int) -> None:
    """ValueError unless a bundle may hold this many neurons."""
    if not 1 <= neurons <= MAX_BUNDLE_NEURONS:
        raise ValueError(f"pi2.bundle.neurons is {neurons}, not 1..{MAX_BUNDLE_NEURONS}")


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
                  neurons: int = 1) -> BundleLayout:
    """The layout of bundles of `neurons` neurons each, padded to a multiple of align."""
    check_bundle_align(align)
    check_bundle_neurons(neurons)
    up_off = row_size(gate_type, n_embd)
    down_off = up_off + row_size(up_type, n_embd)
    end = down_off + row_size(down_type, n_embd)
    stride = -(-end // NEURON_ALIGN) * NEURON_ALIGN
    size = -(-(neurons * stride) // align) * align
    return BundleLayout(up_off, down_off, end, stride, neurons, size)


def tightest_bundle_neurons(gate_type: int, up_type: int, down_type: int, n_embd: int, align: int = BUNDLE_ALIGN) -> int:
    """The number of neurons per bundle (1..MAX_BUNDLE_NEURONS) that pads least per neuron; the fewest on
    ties. Qwen2.5-1.5B's 2,592-byte neurons: 16 per 41,472-byte bundle, no padding (1: 3,072 at 512)."""
    def per_neuron(g: int) -> float:
        return bundle_layout(gate_type, up_type, down_type, n_embd, align, g).size / g
    return min(range(1, MAX_BUNDLE_NEURONS + 1), key=lambda g: (per_neuron(g), g))


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


def tensor_fingerprint(qtype: int, ne0: int, ne1: int, data: np.ndarray) -> int:
    """Fingerprint of one FFN weight tensor from its raw bytes (docs/FORMAT.md, "Fingerprint")."""
    raw = data.reshape(-1).view(np.uint8)
    nbytes = raw.size
    h = fnv1a64(int(qtype).to_bytes(4, "little") + ne0.to_bytes(8, "little") + ne1.to_bytes(8, "little")
                + nbytes.to_bytes(8, "little"))
    s = min(FP_SAMPLE_BYTES, nbytes)
    for k in range(FP_SAMPLES):
        off = k * (nbytes - s) // (FP_SAMPLES - 1)
        h = fnv1a64(raw[off:off + s].tobytes(), h)
    return h


def model_fingerprint(tensor_fps: list[int]) -> int:
    return fnv1a64(b"".join(int(f).to_bytes(8, "little") for f in tensor_fps))
