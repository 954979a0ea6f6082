"""The plugin's C functions that need no registration into llama: the model-file and sidecar readers,
fingerprints, sizes ("600MB"), this process's resident memory, and the down-column kernels (tests)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from ..errors import ModelFileError, SidecarError
from . import capi

Pathish = str | os.PathLike[str]


@dataclass(frozen=True)
class ModelSummary:
    """A model file as pi2 sees it before llama loads it (ggml-pi2.h, pi2_model_summary)."""

    fingerprint: int      # of the gated FFN weights (docs/FORMAT.md); 0 without FFN layers
    ffn_bytes: int        # blk.N.ffn_{gate,up,down}.weight, all layers
    embedding_bytes: int  # token_embd.weight when output.weight is a tensor of its own, else 0
    file_size: int
    n_tensors: int
    n_layer: int          # gated FFN layers
    activation: int       # the FFN activation the model states (<arch>.ffn_activation): index into
                          # sidecar.format.ACTIVATIONS, or -1 when it states none
    activation_threshold: float  # <arch>.ffn_activation_threshold (FATReLU), else 0
    output_bytes: int = 0       # the output matrix: output.weight, or a tied token_embd.weight (counted once)
    output_copy_bytes: int = 0  # its in-RAM copy under PI2_OUTPUT_ROWS (0: none would be smaller, it stays in RAM)
    experts_native: int = 0     # 1: llama.cpp's MoE graph computes the stated expert activation itself (smallthinker ReLU)


def model_summary_c(path: Pathish) -> ModelSummary:
    """The plugin's reading of a model file: ggml's GGUF reader, so a large vocabulary costs little (gguf-py's
    reader builds Python objects for every token). Raises ModelFileError with its message."""
    out = capi.Pi2ModelSummary()
    err = capi.err_buffer()
    if capi.lib().pi2_model_summary(os.fsencode(path), ctypes.byref(out), err, capi.ERR_LEN) != 0:
        raise ModelFileError(capi.err_text(err))
    return ModelSummary(*(getattr(out, name) for name, *_ in capi.Pi2ModelSummary._fields_))


def budget_floor(model: Pathish, sidecar: Pathish, output_rows: int | None) -> capi.Pi2BudgetFloor:
    """The least a memory budget must give this model and sidecar, as the plugin judges it before llama loads
    (ggml-pi2.h, pi2_budget_floor): this process now, the model's resident non-FFN weights, one layer's bundles and
    the margin. output_rows: PI2_OUTPUT_ROWS as the load will have it (None: the sidecar's recorded value)."""
    out = capi.Pi2BudgetFloor()
    err = capi.err_buffer()
    if capi.lib().pi2_budget_floor(os.fsencode(model), os.fsencode(sidecar), -1 if output_rows is None else output_rows,
                                   ctypes.byref(out), err, capi.ERR_LEN) != 0:
        raise SidecarError(capi.err_text(err))
    return out


def validate_sidecar_c(path: Pathish) -> None:
    """Checks a sidecar with the plugin's C reader; raises SidecarError with its message if it refuses."""
    err = capi.err_buffer()
    if capi.lib().pi2_sidecar_validate(os.fsencode(path), err, capi.ERR_LEN) != 0:
        raise SidecarError(capi.err_text(err))


def sidecar_summary_c(path: Pathish) -> tuple[int, int]:
    """(pi2.n_layer, pi2.source.fingerprint) of a sidecar the C reader accepts."""
    err = capi.err_buffer()
    n_layer = ctypes.c_uint32()
    fp = ctypes.c_uint64()
    if capi.lib().pi2_sidecar_summary(os.fsencode(path), ctypes.byref(n_layer), ctypes.byref(fp), err,
                                      capi.ERR_LEN) != 0:
        raise SidecarError(capi.err_text(err))
    return int(n_layer.value), int(fp.value)


def sparse_cost_c(path: Pathish) -> list[float]:
    """Per layer, the plugin's estimate of in-RAM sparse decode time in predicted mode over ggml-cpu's dense
    time with default settings: below 1 PI2 holds the layer (PI2_LAYERS=auto), else leaves it to ggml-cpu."""
    err = capi.err_buffer()
    lib = capi.lib()
    n = lib.pi2_sidecar_sparse_cost(os.fsencode(path), None, 0, err, capi.ERR_LEN)
    if n < 0:
        raise SidecarError(capi.err_text(err))
    out = (ctypes.c_double * max(n, 1))()
    lib.pi2_sidecar_sparse_cost(os.fsencode(path), out, n, err, capi.ERR_LEN)
    return list(out[:n])


def dense_whole_layers(model: Pathish, sidecar: Pathish, cache_bytes: int) -> tuple[list[bool], int]:
    """(per layer: read whole from the model file, the cache bytes those layers take) under a memory budget whose
    caches get cache_bytes, with default settings: the plugin's own rule (PI2_DENSE_READS=auto)."""
    err = capi.err_buffer()
    lib = capi.lib()
    n_max = 4096
    pick = (ctypes.c_uint8 * n_max)()
    whole = ctypes.c_uint64()
    n = lib.pi2_dense_whole_layers(os.fsencode(model), os.fsencode(sidecar), int(cache_bytes), pick, n_max,
                                   ctypes.byref(whole), err, capi.ERR_LEN)
    if n < 0:
        raise SidecarError(capi.err_text(err))
    return [bool(v) for v in pick[:min(n, n_max)]], int(whole.value)


def output_copy_size(model: Pathish, small: bool) -> tuple[int, int] | None:
    """(ggml type, bytes) of the copy output_copy(model, small) makes, from the model's header alone (nothing is
    quantized); None where a load makes none."""
    shape = _output_copy_shape(model, small)
    return (shape[0], shape[1] * shape[2]) if shape is not None else None


def output_copy(model: Pathish, small: bool) -> tuple[int, np.ndarray] | None:
    """(ggml type, [n_vocab, row bytes] uint8): the output matrix's in-RAM copy a memory budget with output rows keeps
    (small: PI2_OUTPUT_COPY=q2_k), made by the plugin's own routine, so a load that reads it from the sidecar has the
    bytes it would have made (of output.weight, else of a tied token_embd.weight); None where a load makes none (no
    such matrix, or no smaller type)."""
    shape = _output_copy_shape(model, small)
    if shape is None:
        return None
    err = capi.err_buffer()
    qtype, n_rows, row_size = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_size_t()
    rows = np.empty(shape[1:], np.uint8)
    rc = capi.lib().pi2_output_copy_make(os.fsencode(model), int(small), ctypes.byref(qtype), ctypes.byref(n_rows),
                                         ctypes.byref(row_size), rows.ctypes.data, rows.nbytes, err, capi.ERR_LEN)
    if rc < 0:
        raise ModelFileError(capi.err_text(err))
    return (int(qtype.value), rows) if rc > 0 else None


def _output_copy_shape(model: Pathish, small: bool) -> tuple[int, int, int] | None:
    """(type, n_rows, row bytes) of the copy, from the tool entry pi2_output_copy_make's size query; None: no copy."""
    err = capi.err_buffer()
    qtype, n_rows, row_size = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_size_t()
    rc = capi.lib().pi2_output_copy_make(os.fsencode(model), int(small), ctypes.byref(qtype), ctypes.byref(n_rows),
                                         ctypes.byref(row_size), None, 0, err, capi.ERR_LEN)
    if rc < 0:
        raise ModelFileError(capi.err_text(err))
    return (int(qtype.value), int(n_rows.value), int(row_size.value)) if rc > 0 else None


def _raw_bytes(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def check_sidecar_weight_c(path: Pathish, layer: int, matrix: int, qtype: int, ne0: int, ne1: int,
                           data: np.ndarray | bytes) -> None:
    """Raises SidecarError unless blk.<layer>.ffn_{gate,up,down}.weight (matrix 0, 1, 2) with these bytes is
    the weight the sidecar was made from."""
    raw = _raw_bytes(data)
    err = capi.err_buffer()
    if capi.lib().pi2_sidecar_check_weight(os.fsencode(path), layer, matrix, int(qtype), ne0, ne1, raw.ctypes.data,
                                           raw.nbytes, err, capi.ERR_LEN) != 0:
        raise SidecarError(capi.err_text(err))


def fingerprint_tensor_c(qtype: int, ne0: int, ne1: int, data: np.ndarray | bytes) -> int:
    """The C fingerprint of one FFN weight tensor from its raw bytes (docs/FORMAT.md, "Fingerprint")."""
    raw = _raw_bytes(data)
    return int(capi.lib().pi2_fingerprint_tensor(int(qtype), ne0, ne1, raw.ctypes.data, raw.nbytes))


def fingerprint_model_c(tensor_fps: list[int]) -> int:
    """The C model fingerprint over 3 * n_layer tensor fingerprints."""
    arr = (ctypes.c_uint64 * len(tensor_fps))(*tensor_fps)
    return int(capi.lib().pi2_fingerprint_model(arr, len(tensor_fps)))


def parse_size(text: str) -> int:
    """Bytes from "600MB" / "0.6GB" (powers of 10), "512MiB" (powers of 2) or a plain number, any case:
    the plugin's parser, the one every PI2_* size goes through. ValueError if text is not a size."""
    out = ctypes.c_uint64()
    if capi.lib().pi2_parse_size(text.encode(), ctypes.byref(out)) != 0:
        raise ValueError(f"'{text}' is not a size (e.g. 600MB, 2GiB, 1500000000)")
    return int(out.value)


def resident_bytes() -> int:
    """This process's resident memory (after the plugin returns freed heap to the system); 0 if unreadable."""
    return int(capi.lib().pi2_resident_bytes())


def config_names() -> list[str]:
    """Every PI2_* variable the plugin reads."""
    buf = ctypes.create_string_buffer(8192)
    if capi.lib().pi2_config_names(buf, len(buf)) != 0:
        raise RuntimeError("pi2_config_names: the buffer is too small")
    return buf.value.decode().split(",")


def columns_add(qtype: int, y: np.ndarray, a: np.ndarray, columns: np.ndarray) -> None:
    """y += sum of a[c] * column c, in place, by the plugin's down-column kernels, grouped as sparse decode
    groups its active neurons. columns: [n_cols] rows of quantized bytes of y's length each (for tests)."""
    y = np.asarray(y)
    if y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError("y must be a contiguous float32 array")
    a = np.ascontiguousarray(a, dtype=np.float32)
    columns = np.ascontiguousarray(columns, dtype=np.uint8)
    ptrs = (ctypes.c_void_p * len(a))(*[columns[c].ctypes.data for c in range(len(a))])
    if capi.lib().pi2_columns_add(int(qtype), y.size, y.ctypes.data, len(a), a.ctypes.data, ptrs) != 0:
        raise ValueError(f"no column kernel for type {qtype} and length {y.size}")


def dot_rows_tokens(qtype: int, rows: np.ndarray, x: np.ndarray, kernel: bool = True) -> tuple[np.ndarray, bool]:
    """([n_tokens, n_rows] float32 products of every row with every token, whether the several-token kernel computed
    them) as a prompt batch computes gate and up rows. rows: [n_rows, row bytes] uint8 of a ggml type; x: [n_tokens, n]
    float32, converted to the type's vec_dot_type by ggml. kernel False: ggml-cpu's vec_dot a token at a time. For tests."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or rows.ndim != 2:
        raise ValueError("rows must be [n_rows, row bytes] and x [n_tokens, n]")
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if x.shape[1] % block != 0 or rows.shape[1] != x.shape[1] // block * nbytes:
        raise ValueError(f"rows of {rows.shape[1]} bytes are not rows of {x.shape[1]} values of type {qtype}")
    out = np.zeros((x.shape[0], rows.shape[0]), dtype=np.float32)
    rc = capi.lib().pi2_dot_rows_tokens(int(qtype), x.shape[1], rows.shape[0], rows.ctypes.data, x.shape[0],
                                        x.ctypes.data, out.ctypes.data, int(kernel))
    if rc < 0:
        raise ValueError(f"no dot product for type {qtype} and rows of {x.shape[1]}")
    return out, rc == 1


def columns_add_batch(qtype: int, y: np.ndarray, a: np.ndarray, columns: list[np.ndarray | None]) -> None:
    """y[t] += sum of a[t, c] * column c for every token t, in place, as a prompt batch on flash sums a cluster's
    columns (dequantized once, four tokens at a time). y: [n_tokens, n] float32; a: [n_tokens, n_cols]; columns:
    n_cols rows of quantized bytes (None: a column no token computed). For tests."""
    y = np.asarray(y)
    if y.dtype != np.float32 or y.ndim != 2 or not y.flags.c_contiguous:
        raise ValueError("y must be a contiguous [n_tokens, n] float32 array")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != (y.shape[0], len(columns)):
        raise ValueError(f"a must be [{y.shape[0]}, {len(columns)}], got {list(a.shape)}")
    kept = [None if c is None else np.ascontiguousarray(c, dtype=np.uint8) for c in columns]
    ptrs = (ctypes.c_void_p * len(kept))(*[None if c is None else c.ctypes.data for c in kept])
    if capi.lib().pi2_columns_add_batch(int(qtype), y.shape[1], y.shape[0], y.ctypes.data, len(kept), a.ctypes.data,
                                        ptrs) != 0:
        raise ValueError(f"no batch column kernel for type {qtype}, length {y.shape[1]} and {len(kept)} columns")
