"""libggml-base.so.0 of the installed llama-cpp-python wheel, opened once through ctypes with the few
functions the Python tools call: tensor names and data from graph callbacks, ggml's quantizer and its
dequantizers (to_float of the type traits: C, ~50x gguf-py's numpy dequantize on Q4_K)."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    import llama_cpp

    g = ctypes.CDLL(str(Path(llama_cpp.__file__).resolve().parent / "lib" / "libggml-base.so.0"))
    g.ggml_get_name.restype = ctypes.c_char_p
    g.ggml_get_name.argtypes = [ctypes.c_void_p]
    g.ggml_backend_tensor_get.restype = None
    g.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    g.ggml_quantize_chunk.restype = ctypes.c_size_t
    g.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    g.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    g.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    g.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    g.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return g


_ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


GGML_TYPE_F32 = 0


def to_float(qtype: int, data: np.ndarray, n: int) -> np.ndarray:
    """n float32 values from ggml data of type qtype (n a whole number of blocks; data holds them all)."""
    buf = np.ascontiguousarray(data)
    if qtype == GGML_TYPE_F32:
        return buf.view(np.float32).reshape(-1)[:n].copy()
    traits = lib().ggml_get_type_traits(qtype).contents
    if not traits.to_float:
        raise ValueError(f"ggml type {qtype} has no dequantizer")
    if buf.nbytes < n // traits.blck_size * traits.type_size or n % traits.blck_size:
        raise ValueError(f"{n} values of ggml type {qtype} need {n // traits.blck_size * traits.type_size} "
                         f"bytes in whole blocks of {traits.blck_size}; got {buf.nbytes}")
    out = np.empty(n, dtype=np.float32)
    _ToFloat(traits.to_float)(buf.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out
