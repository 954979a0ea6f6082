"""Writing and reading the pi2 sidecar GGUF (docs/FORMAT.md) with gguf-py."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from . import format as fmt
from ..errors import SidecarError
from ..gguf_file import open_gguf


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


@dataclass
class SidecarMeta:
    source_architecture: str
    source_name: str
    source_file_size: int
    tensor_fingerprints: list[int]
    n_embd: int
    activation: str
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


_ADD: dict[fmt.KT, Callable[[GGUFWriter, str, Any], None]] = {
    fmt.KT.U32: lambda w, k, v: w.add_uint32(k, int(v)),
    fmt.KT.U64: lambda w, k, v: w.add_uint64(k, int(v)),
    fmt.KT.F32: lambda w, k, v: w.add_float32(k, float(v)),
    fmt.KT.STR: lambda w, k, v: w.add_string(k, str(v)),
    fmt.KT.U32_ARR: lambda w, k, v: w.add_key_value(k, [int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.UINT32),
    fmt.KT.U64_ARR: lambda w, k, v: w.add_key_value(k, [int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    fmt.KT.F32_ARR: lambda w, k, v: w.add_key_value(k, [float(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
}


# per-layer keys and the LayerData field each comes from
_PER_LAYER = {
    "pi2.n_ff": "n_ff", "pi2.sparsity.thresholds": "threshold", "pi2.sparsity.density": "density",
    "pi2.predictor.rank": "rank", "pi2.predictor.cutoff": "cutoff", "pi2.predictor.recall": "recall",
    "pi2.predictor.precision": "precision", "pi2.predictor.density": "predicted_density",
    "pi2.hot_count": "hot_count", "pi2.bundle.size": "bundle_size", "pi2.bundle.neurons": "bundle_neurons",
    "pi2.bundle.gate_type": "gate_type",
    "pi2.bundle.up_type": "up_type", "pi2.bundle.down_type": "down_type",
    "pi2.bundle.down_tolerance": "down_tolerance", "pi2.bundle.down_error": "down_error",
    "pi2.sparsity.product_thresholds": "product_threshold",
}


def _key_values(m: SidecarMeta) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "pi2.format_version": fmt.FORMAT_VERSION,
        "pi2.source.architecture": m.source_architecture,
        "pi2.source.name": m.source_name,
        "pi2.source.file_size": m.source_file_size,
        "pi2.source.fingerprint": fmt.model_fingerprint(m.tensor_fingerprints),
        "pi2.source.tensor_fingerprints": m.tensor_fingerprints,
        "pi2.n_layer": len(m.layers),
        "pi2.n_embd": m.n_embd,
        "pi2.activation": m.activation,
        "pi2.sparsity.method": m.method,
        "pi2.sparsity.target": m.target,
        "pi2.predictor.recall_target": m.recall_target,
        "pi2.calib.corpus": m.corpus,
        "pi2.calib.corpus_sha256": m.corpus_sha256,
        "pi2.calib.tokens": m.tokens,
        "pi2.calib.heldout_tokens": m.heldout_tokens,
        "pi2.calib.date": m.date,
        "pi2.bundle.align": m.bundle_align,
    }
    for key, attr in _PER_LAYER.items():
        if key in fmt.keys_of(m.method):
            kv[key] = [getattr(ld, attr) for ld in m.layers]
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


def write(path: str | Path, meta: SidecarMeta, bundles: Callable[[int], np.ndarray],
          progress: Callable[[int], None] | None = None) -> Path:
    """Writes the sidecar atomically (temp file beside it, then rename). bundles(layer) returns that
    layer's [n_bundles, bundle size] uint8 array."""
    out = Path(path)
    kv = _key_values(meta)
    if set(kv) != set(fmt.keys_of(meta.method)):
        raise AssertionError(f"writer keys differ from the format: {sorted(set(kv) ^ set(fmt.keys_of(meta.method)))}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = GGUFWriter(tmp, fmt.ARCHITECTURE)
    try:
        w.add_custom_alignment(fmt.BUNDLE_ALIGN)
        for k, v in kv.items():
            _ADD[fmt.KEYS[k]](w, k, v)
        order: list[tuple[int, str, np.ndarray | None]] = []
        for il, ld in enumerate(meta.layers):
            for name, arr in _small_tensors(il, ld):
                w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes)
                order.append((il, name, arr))
            name = fmt.tensor_name(il, "pi2_bundles")
            shape = (ld.n_bundles, ld.bundle_size)
            w.add_tensor_info(name, shape, np.dtype(np.int8), ld.n_bundles * ld.bundle_size)
            order.append((il, name, None))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for il, name, arr in order:
            if arr is None:
                b = bundles(il)
                ld = meta.layers[il]
                if b.shape != (ld.n_bundles, ld.bundle_size) or b.dtype != np.uint8:
                    raise AssertionError(f"bundles of layer {il}: {b.shape} {b.dtype}")
                w.write_tensor_data(b.view(np.int8))
                if progress:
                    progress(il)
            else:
                w.write_tensor_data(arr)
        w.close()
        os.replace(tmp, out)
    finally:
        if w.fout is not None:
            w.close()
        tmp.unlink(missing_ok=True)
    return out


# --- reading ---------------------------------------------------------------------------------------

@dataclass
class Sidecar:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor
    reader: GGUFReader

    @property
    def n_layer(self) -> int:
        return int(self.kv["pi2.n_layer"])

    def layer_tensor(self, il: int, suffix: str) -> np.ndarray:
        return np.asarray(self.tensors[fmt.tensor_name(il, suffix)].data)

    def bundles(self, il: int) -> np.ndarray:
        """[n_bundles, bundle size] uint8 view into the file."""
        return self.layer_tensor(il, "pi2_bundles").view(np.uint8)

    def layout(self, il: int) -> fmt.BundleLayout:
        kv = self.kv
        return fmt.bundle_layout(int(kv["pi2.bundle.gate_type"][il]), int(kv["pi2.bundle.up_type"][il]),
                                 int(kv["pi2.bundle.down_type"][il]), int(kv["pi2.n_embd"]),
                                 int(kv["pi2.bundle.align"]), int(kv["pi2.bundle.neurons"][il]),
                                 int(kv["pi2.bundle.size"][il]))

    def slots(self, il: int) -> np.ndarray:
        """[n_ff, end of a neuron's parts] uint8 (a copy): row j = the parts of bundle slot j."""
        lay, n_ff = self.layout(il), int(self.kv["pi2.n_ff"][il])
        flat = self.bundles(il).reshape(-1)
        return np.stack([flat[lay.offset(j):lay.offset(j) + lay.end] for j in range(n_ff)])

    def bundle_slices(self, il: int) -> tuple[slice, slice, slice]:
        """Gate row, up row and down column within a row of slots()."""
        lay = self.layout(il)
        return slice(0, lay.up_offset), slice(lay.up_offset, lay.down_offset), slice(lay.down_offset, lay.end)

    def check_model(self, tensor_fingerprints: list[int], model_path: str | Path) -> None:
        """Raises SidecarError unless the sidecar was made from a model with these FFN weights."""
        ours = [int(x) for x in self.kv["pi2.source.tensor_fingerprints"]]
        if len(ours) != len(tensor_fingerprints):
            raise SidecarError(f"sidecar {self.path} was made for another model: it covers {len(ours) // 3} FFN "
                               f"layers, {model_path} has {len(tensor_fingerprints) // 3}")
        for i, (a, b) in enumerate(zip(ours, tensor_fingerprints)):
            if a != b:
                raise SidecarError(f"sidecar {self.path} was made for another model: the fingerprint of "
                                   f"blk.{i // 3}.ffn_{('gate', 'up', 'down')[i % 3]}.weight in {model_path} is "
                                   f"{b:016x}, the sidecar expects {a:016x}")


def _field_value(reader: GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    if f is None:
        return None
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return [f.parts[i][0].item() for i in f.data]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(np.asarray(f.parts[f.data[0]])).decode("utf-8", errors="replace")
    return f.parts[f.data[0]][0].item()


_EXPECT_TYPE = {fmt.KT.U32: GGUFValueType.UINT32, fmt.KT.U64: GGUFValueType.UINT64, fmt.KT.F32: GGUFValueType.FLOAT32,
                fmt.KT.STR: GGUFValueType.STRING, fmt.KT.U32_ARR: GGUFValueType.UINT32,
                fmt.KT.U64_ARR: GGUFValueType.UINT64, fmt.KT.F32_ARR: GGUFValueType.FLOAT32}


def read(path: str | Path) -> Sidecar:
    """Opens and validates a sidecar (every rule of docs/FORMAT.md except the model fingerprint)."""
    p, reader = open_gguf(path, "sidecar", SidecarError)
    version = _field_value(reader, "pi2.format_version")
    if version is None:
        raise SidecarError(f"{p} is not a pi2 sidecar (no pi2.format_version)")
    if version != fmt.FORMAT_VERSION:
        raise SidecarError(f"sidecar {p} has format version {version}; this pi2-gguf reads version "
                           f"{fmt.FORMAT_VERSION} (convert the model again)")
    method = _field_value(reader, "pi2.sparsity.method")
    if method is None:
        raise SidecarError(f"sidecar {p} lacks key pi2.sparsity.method")
    if method not in fmt.SPARSITY_METHODS:
        raise SidecarError(f"sidecar {p}: pi2.sparsity.method is {method!r}, not one of {', '.join(fmt.SPARSITY_METHODS)}")
    keys = fmt.keys_of(method)
    kv: dict[str, Any] = {}
    for key, kt in keys.items():
        f = reader.get_field(key)
        if f is None:
            raise SidecarError(f"sidecar {p} lacks key {key}" + (f" (method {method} needs it)" if key in fmt.METHOD_KEYS else ""))
        is_arr = kt.value.endswith("[]")
        got = f.types[-1] if f.types else None
        if (f.types[0] == GGUFValueType.ARRAY) != is_arr or got != _EXPECT_TYPE[kt]:
            raise SidecarError(f"sidecar {p}: key {key} has type {[t.name for t in f.types]}, expected {kt.value}")
        kv[key] = _field_value(reader, key)
    n_layer = int(kv["pi2.n_layer"])
    for key, kt in keys.items():
        if kt.value.endswith("[]"):
            want = 3 * n_layer if key == "pi2.source.tensor_fingerprints" else n_layer
            if len(kv[key]) != want:
                raise SidecarError(f"sidecar {p}: {key} has {len(kv[key])} elements, expected {want}")
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if int(t.data_offset) % fmt.BUNDLE_ALIGN:
            raise SidecarError(f"sidecar {p}: tensor {t.name} is not {fmt.BUNDLE_ALIGN}-byte aligned")
    align = int(kv["pi2.bundle.align"])
    try:
        fmt.check_bundle_align(align)
    except ValueError as e:
        raise SidecarError(f"sidecar {p}: {e}") from e
    sc = Sidecar(p, kv, tensors, reader)
    n_embd = int(kv["pi2.n_embd"])
    for il in range(n_layer):
        n_ff, bsize = int(kv["pi2.n_ff"][il]), int(kv["pi2.bundle.size"][il])
        try:  # also refuses a bundle size that does not hold the layer's neurons
            lay = sc.layout(il)
        except ValueError as e:
            raise SidecarError(f"sidecar {p}: layer {il}: {e}") from e
        dims = {"n_embd": n_embd, "n_ff": n_ff, "r": int(kv["pi2.predictor.rank"][il]),
                "bundle size": bsize, "n_bundles": lay.n_bundles(n_ff)}
        for suffix, (tname, shape) in fmt.TENSORS.items():
            name = fmt.tensor_name(il, suffix)
            t = tensors.get(name)
            if t is None:
                raise SidecarError(f"sidecar {p} lacks tensor {name}")
            want = [dims[d] for d in shape]
            if t.tensor_type != GGMLQuantizationType[tname] or [int(x) for x in t.shape] != want:
                raise SidecarError(f"sidecar {p}: tensor {name} is {t.tensor_type.name} {list(t.shape)}, "
                                   f"expected {tname} {want}")
        order = sc.layer_tensor(il, "pi2_order")
        if not np.array_equal(np.sort(order), np.arange(dims["n_ff"])):
            raise SidecarError(f"sidecar {p}: blk.{il}.pi2_order is not a permutation of the layer's neurons")
    return sc
