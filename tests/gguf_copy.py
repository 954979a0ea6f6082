"""A GGUF copied with changes, for tests that need a variant of a model (gguf-py reader and writer)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from pi2_gguf.converter.bundles import quantize_rows


def copy_gguf(src: Path, dst: Path, extra: Callable[[str, np.ndarray], Iterable[tuple[str, np.ndarray]]] | None = None,
              set_kv: dict[str, str | np.float32] | None = None,
              quantize: Callable[[str], GGMLQuantizationType | None] | None = None,
              drop_kv: Iterable[str] = ()) -> Path:
    """src's fields and tensors into dst, each tensor followed by the (name, array) tensors extra(name, data)
    gives, and the keys of set_kv set (str: a string, np.float32: a float32). Numpy dtypes carry the tensor
    types: for models with F32/F16 tensors, as the synthetic test models. Keys in drop_kv are left out. quantize(name), where given and not None,
    is the ggml type a tensor (or an extra one) is written in instead, its F32/F16 rows quantized by ggml."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    set_kv = set_kv or {}
    drop_kv = set(drop_kv)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in set_kv or name in drop_kv:
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, value in set_kv.items():
        w.add_key_value(name, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.FLOAT32)
    def add(name: str, data: np.ndarray) -> None:
        qt = quantize(name) if quantize is not None else None
        w.add_tensor(name, data if qt is None else quantize_rows(qt, data.astype(np.float32)), raw_dtype=qt)

    for t in r.tensors:
        data = np.array(t.data)
        add(t.name, data)
        for name, more in (extra(t.name, data) if extra is not None else ()):
            add(name, more)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
