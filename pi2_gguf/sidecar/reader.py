"""Reading and validating the pi2 sidecar GGUF (docs/FORMAT.md) with gguf-py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from ..errors import SidecarError, SidecarVersionError
from ..gguf_file import open_gguf
from . import format as fmt
from .format import Key


@dataclass
class Sidecar:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor
    reader: GGUFReader

    @property
    def n_layer(self) -> int:
        return int(self.kv[Key.N_LAYER])

    @property
    def whole_layers(self) -> frozenset[int]:
        """Sidecar layers read whole from the model file (routed experts with pi2.moe.expert_reads = model, every layer of
        a dense model with pi2.dense_reads = model): no tensors."""
        if self.kv.get(Key.DENSE_READS) == "model":
            return frozenset(range(self.n_layer))
        if self.kv.get(Key.MOE_EXPERT_READS) != "model":
            return frozenset()
        return frozenset(fmt.routed_layers(self.kv.get(Key.MOE_LAYER_EXPERTS), int(self.kv[Key.MOE_EXPERT_COUNT]),
                                           self.n_layer))

    def layer_tensor(self, il: int, suffix: str) -> np.ndarray:
        return np.asarray(self.tensors[fmt.tensor_name(il, suffix)].data)

    def bundles(self, il: int) -> np.ndarray:
        """[n_bundles, bundle size] uint8 view into the file."""
        return self.layer_tensor(il, "pi2_bundles").view(np.uint8)

    def layout(self, il: int) -> fmt.BundleLayout:
        kv = self.kv
        return fmt.bundle_layout(int(kv[Key.BUNDLE_GATE_TYPE][il]), int(kv[Key.BUNDLE_UP_TYPE][il]),
                                 int(kv[Key.BUNDLE_DOWN_TYPE][il]), int(kv[Key.N_EMBD]),
                                 int(kv[Key.BUNDLE_ALIGN]), int(kv[Key.BUNDLE_NEURONS][il]),
                                 int(kv[Key.BUNDLE_SIZE][il]))

    def slots(self, il: int) -> np.ndarray:
        """[n_ff, end of a neuron's parts] uint8 (a copy): row j = the parts of bundle slot j."""
        lay, n_ff = self.layout(il), int(self.kv[Key.N_FF][il])
        flat = self.bundles(il).reshape(-1)
        return np.stack([flat[lay.offset(j):lay.offset(j) + lay.end] for j in range(n_ff)])

    def bundle_slices(self, il: int) -> tuple[slice, slice, slice]:
        """Gate row, up row and down column within a row of slots()."""
        lay = self.layout(il)
        return slice(0, lay.up_offset), slice(lay.up_offset, lay.down_offset), slice(lay.down_offset, lay.end)


def _field_value(reader: GGUFReader, key: str, path: Path) -> Any:
    """The key's value (a list for arrays), or None without the key."""
    f = reader.get_field(key)
    try:
        return None if f is None else f.contents()
    except UnicodeDecodeError as e:
        raise SidecarError(f"sidecar {path}: key {key} is not UTF-8 text ({e.reason} at byte {e.start})") from e


_EXPECT_TYPE = {fmt.KT.U32: GGUFValueType.UINT32, fmt.KT.U64: GGUFValueType.UINT64, fmt.KT.F32: GGUFValueType.FLOAT32,
                fmt.KT.STR: GGUFValueType.STRING, fmt.KT.U32_ARR: GGUFValueType.UINT32,
                fmt.KT.U64_ARR: GGUFValueType.UINT64, fmt.KT.F32_ARR: GGUFValueType.FLOAT32}


def read(path: str | Path) -> Sidecar:
    """Opens and validates a sidecar (every rule of docs/FORMAT.md except the model fingerprint)."""
    p, reader = open_gguf(path, "sidecar", SidecarError)
    version = _field_value(reader, Key.FORMAT_VERSION, p)
    if version is None:
        raise SidecarError(f"{p} is not a pi2 sidecar (no {Key.FORMAT_VERSION})")
    if version != fmt.FORMAT_VERSION:
        raise SidecarVersionError(f"sidecar {p} has format version {version}; this pi2-gguf reads version "
                           f"{fmt.FORMAT_VERSION} (convert the model again)")
    method = _field_value(reader, Key.SPARSITY_METHOD, p)
    if method is None:
        raise SidecarError(f"sidecar {p} lacks key {Key.SPARSITY_METHOD}")
    if method not in fmt.SPARSITY_METHODS:
        raise SidecarError(f"sidecar {p}: {Key.SPARSITY_METHOD} is {method!r}, not one of "
                           f"{', '.join(fmt.SPARSITY_METHODS)}")
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
        kv[key] = _field_value(reader, key, p)
    for key, kt in fmt.OPTIONAL_KEYS.items():  # kept where present with the declared type, else ignored
        f = reader.get_field(key)
        is_arr = kt.value.endswith("[]")
        if f is not None and f.types and (f.types[0] == GGUFValueType.ARRAY) == is_arr and f.types[-1] == _EXPECT_TYPE[kt]:
            kv[key] = _field_value(reader, key, p)
    # ... except the one the plugin applies: a malformed setting is refused, as the plugin refuses it
    f = reader.get_field(Key.MOE_EXPERT_COUNT)
    if f is not None:
        n_expert = kv.get(Key.MOE_EXPERT_COUNT)
        if not isinstance(n_expert, int):
            raise SidecarError(f"sidecar {p}: key {Key.MOE_EXPERT_COUNT} has type {[t.name for t in f.types]}, "
                               "expected u32")
        n_layer = len(kv[Key.N_FF])
        g = reader.get_field(Key.MOE_LAYER_EXPERTS)
        if g is not None and Key.MOE_LAYER_EXPERTS not in kv:
            raise SidecarError(f"sidecar {p}: key {Key.MOE_LAYER_EXPERTS} has type {[t.name for t in g.types]}, "
                               "expected u32[]")
        try:
            fmt.moe_layer_first(kv.get(Key.MOE_LAYER_EXPERTS), n_expert, n_layer)
        except ValueError as e:
            raise SidecarError(f"sidecar {p}: {e}") from e
        for key in (Key.MOE_ROUTED_SHARE, Key.MOE_REUSE):
            values = kv.get(key)
            if values is not None and len(values) != n_layer:
                raise SidecarError(f"sidecar {p}: key {key} has {len(values)} values for {n_layer} layers")
    elif reader.get_field(Key.MOE_LAYER_EXPERTS) is not None:
        raise SidecarError(f"sidecar {p}: has key {Key.MOE_LAYER_EXPERTS} but no {Key.MOE_EXPERT_COUNT}")
    f = reader.get_field(Key.MOE_EXPERT_READS)
    if f is not None:  # as the plugin refuses it
        if kv.get(Key.MOE_EXPERT_READS) not in fmt.EXPERT_READS:
            raise SidecarError(f"sidecar {p}: key {Key.MOE_EXPERT_READS} is not the string "
                               f"{' or '.join(fmt.EXPERT_READS)}")
        if Key.MOE_EXPERT_COUNT not in kv:
            raise SidecarError(f"sidecar {p}: has key {Key.MOE_EXPERT_READS} but no {Key.MOE_EXPERT_COUNT}")
    f = reader.get_field(Key.DENSE_READS)
    if f is not None:  # as the plugin refuses it
        if kv.get(Key.DENSE_READS) not in fmt.DENSE_READS:
            raise SidecarError(f"sidecar {p}: key {Key.DENSE_READS} is not the string {' or '.join(fmt.DENSE_READS)}")
        if Key.MOE_EXPERT_COUNT in kv:
            raise SidecarError(f"sidecar {p}: has key {Key.DENSE_READS}, which only a dense model's sidecar has, beside "
                               f"{Key.MOE_EXPERT_COUNT}")
    if reader.get_field(Key.PREDICTOR_W2_TYPE) is not None and kv.get(Key.PREDICTOR_W2_TYPE) not in fmt.PREDICTOR_W2_TYPES:
        raise SidecarError(f"sidecar {p}: key {Key.PREDICTOR_W2_TYPE} is not the string "
                           f"{' or '.join(fmt.PREDICTOR_W2_TYPES)}")  # as the plugin refuses it
    f = reader.get_field(Key.BUDGET_OUTPUT_ROWS)
    if f is not None:
        rows = kv.get(Key.BUDGET_OUTPUT_ROWS)
        if rows is None:
            raise SidecarError(f"sidecar {p}: key {Key.BUDGET_OUTPUT_ROWS} has type {[t.name for t in f.types]}, "
                               "expected u32")
        if rows > fmt.MAX_OUTPUT_ROWS:
            raise SidecarError(f"sidecar {p}: key {Key.BUDGET_OUTPUT_ROWS}: PI2_OUTPUT_ROWS={rows} is not a number of "
                               f"rows from 0 to {fmt.MAX_OUTPUT_ROWS}")
    f = reader.get_field(Key.BUDGET_OUTPUT_COPY)
    if f is not None and kv.get(Key.BUDGET_OUTPUT_COPY) not in fmt.OUTPUT_COPIES:
        raise SidecarError(f"sidecar {p}: key {Key.BUDGET_OUTPUT_COPY} is {kv.get(Key.BUDGET_OUTPUT_COPY)!r}, "
                           "not one of "
                           f"PI2_OUTPUT_COPY's values {', '.join(fmt.OUTPUT_COPIES)}")
    n_layer = int(kv[Key.N_LAYER])
    for key, kt in keys.items():
        if kt.value.endswith("[]"):
            want = 3 * n_layer if key == Key.SOURCE_TENSOR_FINGERPRINTS else n_layer
            if len(kv[key]) != want:
                raise SidecarError(f"sidecar {p}: {key} has {len(kv[key])} elements, expected {want}")
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if int(t.data_offset) % fmt.BUNDLE_ALIGN:
            raise SidecarError(f"sidecar {p}: tensor {t.name} is not {fmt.BUNDLE_ALIGN}-byte aligned")
    align = int(kv[Key.BUNDLE_ALIGN])
    try:
        fmt.check_bundle_align(align)
    except ValueError as e:
        raise SidecarError(f"sidecar {p}: {e}") from e
    copy = tensors.get(fmt.OUTPUT_COPY_TENSOR)
    if copy is not None:  # as the plugin refuses it
        copy_types, _ = fmt.OPTIONAL_TENSORS[fmt.OUTPUT_COPY_TENSOR]
        copy_shape = [int(x) for x in copy.shape]
        if (copy.tensor_type.name not in copy_types or len(copy_shape) != 2 or copy_shape[0] != int(kv[Key.N_EMBD])
                or copy_shape[1] < 1):
            raise SidecarError(f"sidecar {p}: tensor {fmt.OUTPUT_COPY_TENSOR} is {copy.tensor_type.name} {copy_shape}, "
                               f"expected {', '.join(copy_types)} [n_embd = {kv[Key.N_EMBD]}, n_vocab]")
    sc = Sidecar(p, kv, tensors, reader)
    n_embd = int(kv[Key.N_EMBD])
    whole = sc.whole_layers
    for il in range(n_layer):
        if il in whole:
            continue  # read whole from the model file: no bundles, predictor or ranking
        n_ff, bsize = int(kv[Key.N_FF][il]), int(kv[Key.BUNDLE_SIZE][il])
        try:  # also refuses a bundle size that does not hold the layer's neurons
            lay = sc.layout(il)
        except ValueError as e:
            raise SidecarError(f"sidecar {p}: layer {il}: {e}") from e
        dims = {"n_embd": n_embd, "n_ff": n_ff, "r": int(kv[Key.PREDICTOR_RANK][il]),
                "bundle size": bsize, "n_bundles": lay.n_bundles(n_ff)}
        for suffix, (tname, shape) in fmt.TENSORS.items():
            name = fmt.tensor_name(il, suffix)
            tensor = tensors.get(name)
            if tensor is None:
                raise SidecarError(f"sidecar {p} lacks tensor {name}")
            want_shape = [dims[d] for d in shape]
            if tensor.tensor_type != GGMLQuantizationType[tname] or [int(x) for x in tensor.shape] != want_shape:
                raise SidecarError(f"sidecar {p}: tensor {name} is {tensor.tensor_type.name} {list(tensor.shape)}, "
                                   f"expected {tname} {want_shape}")
        order = sc.layer_tensor(il, "pi2_order")
        if not np.array_equal(np.sort(order), np.arange(dims["n_ff"])):
            raise SidecarError(f"sidecar {p}: blk.{il}.pi2_order is not a permutation of the layer's neurons")
    return sc
