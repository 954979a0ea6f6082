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
    version = _field_value(reader, "pi2.format_version", p)
    if version is None:
        raise SidecarError(f"{p} is not a pi2 sidecar (no pi2.format_version)")
    if version != fmt.FORMAT_VERSION:
        raise SidecarVersionError(f"sidecar {p} has format version {version}; this pi2-gguf reads version "
                           f"{fmt.FORMAT_VERSION} (convert the model again)")
    method = _field_value(reader, "pi2.sparsity.method", p)
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
        kv[key] = _field_value(reader, key, p)
    for key, kt in fmt.OPTIONAL_KEYS.items():  # kept where present with the declared type, else ignored
        f = reader.get_field(key)
        is_arr = kt.value.endswith("[]")
        if f is not None and f.types and (f.types[0] == GGUFValueType.ARRAY) == is_arr and f.types[-1] == _EXPECT_TYPE[kt]:
            kv[key] = _field_value(reader, key, p)
    # ... except the one the plugin applies: a malformed setting is refused, as the plugin refuses it
    f = reader.get_field("pi2.moe.expert_count")
    if f is not None:
        n_expert = kv.get("pi2.moe.expert_count")
        if not isinstance(n_expert, int):
            raise SidecarError(f"sidecar {p}: key pi2.moe.expert_count has type {[t.name for t in f.types]}, expected u32")
        n_layer = len(kv["pi2.n_ff"])
        if n_expert == 0 or n_layer % n_expert:
            raise SidecarError(f"sidecar {p}: key pi2.moe.expert_count is {n_expert}, which does not divide its {n_layer} layers")
        for key in ("pi2.moe.routed_share", "pi2.moe.reuse"):
            values = kv.get(key)
            if values is not None and len(values) != n_layer:
                raise SidecarError(f"sidecar {p}: key {key} has {len(values)} values for {n_layer} layers")
    f = reader.get_field("pi2.budget.output_rows")
    if f is not None:
        rows = kv.get("pi2.budget.output_rows")
        if rows is None:
            raise SidecarError(f"sidecar {p}: key pi2.budget.output_rows has type {[t.name for t in f.types]}, expected u32")
        if rows > fmt.MAX_OUTPUT_ROWS:
            raise SidecarError(f"sidecar {p}: key pi2.budget.output_rows: PI2_OUTPUT_ROWS={rows} is not a number of "
                               f"rows from 0 to {fmt.MAX_OUTPUT_ROWS}")
    f = reader.get_field("pi2.budget.output_copy")
    if f is not None and kv.get("pi2.budget.output_copy") not in fmt.OUTPUT_COPIES:
        raise SidecarError(f"sidecar {p}: key pi2.budget.output_copy is {kv.get('pi2.budget.output_copy')!r}, not one of "
                           f"PI2_OUTPUT_COPY's values {', '.join(fmt.OUTPUT_COPIES)}")
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
