"""A GGUF copied with changes, for tests that need a variant of a model (gguf-py reader and writer)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from pi2_gguf.converter.bundles import quantize_rows


# the tensor types numpy's dtypes carry
_NUMPY_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64, GGMLQuantizationType.I8,
                GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64}


def copy_gguf(src: Path, dst: Path, extra: Callable[[str, np.ndarray], Iterable[tuple[str, np.ndarray]]] | None = None,
              set_kv: dict[str, str | np.float32] | None = None,
              quantize: Callable[[str], GGMLQuantizationType | None] | None = None,
              drop_kv: Iterable[str] = (), drop_tensors: Iterable[str] = ()) -> Path:
    """src's fields and tensors into dst, each tensor followed by the (name, array) tensors extra(name, data)
    gives, and the keys of set_kv set (str: a string, np.float32: a float32). Numpy dtypes carry the tensor
    types: for models with F32/F16 tensors, as the synthetic test models; a quantized tensor of src is copied as its
    bytes (an extra one in uint8 rows keeps the type of the tensor it follows). Keys in drop_kv and tensors in
    drop_tensors are left out; general.alignment is kept. quantize(name), where given and not None, is the ggml type a
    tensor (or an extra one) is written in instead, its F32/F16 rows quantized by ggml."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    set_kv = set_kv or {}
    drop_kv = set(drop_kv)
    drop_tensors = set(drop_tensors)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in set_kv or name in drop_kv:
            continue
        if name == "general.alignment":
            w.data_alignment = int(f.contents())
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, value in set_kv.items():
        w.add_key_value(name, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.FLOAT32)
    def add(name: str, data: np.ndarray, raw: GGMLQuantizationType | None) -> None:
        qt = quantize(name) if quantize is not None else None
        if qt is not None:
            w.add_tensor(name, quantize_rows(qt, data.astype(np.float32)), raw_dtype=qt)
        else:
            w.add_tensor(name, data, raw_dtype=raw if data.dtype == np.uint8 else None)

    for t in r.tensors:
        data = np.array(t.data)
        raw = t.tensor_type if t.tensor_type not in _NUMPY_TYPES else None
        if t.name not in drop_tensors:
            add(t.name, data, raw)
        for name, more in (extra(t.name, data) if extra is not None else ()):
            add(name, more, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
