"""ggml's own functions, declared once on the Python side: libggml-base.so.0 and libggml.so.0 of the installed
llama-cpp-python wheel, each opened once through ctypes with the few functions the Python tools call: tensor
names and data from graph callbacks, ggml's quantizer and its dequantizers (to_float of the type traits: C,
~50x gguf-py's numpy dequantize on Q4_K), and the backend registry the plugin is loaded into.

(The plugin's own C API is declared in capi.py.)"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_bool, c_char_p, c_int, c_int64, c_size_t, c_void_p
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import PluginError

_ToFloat = ctypes.CFUNCTYPE(None, c_void_p, POINTER(ctypes.c_float), c_int64)


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", c_char_p), ("blck_size", c_int64),
                ("blck_size_interleave", c_int64), ("type_size", c_size_t),
                ("is_quantized", c_bool), ("to_float", c_void_p), ("from_float_ref", c_void_p)]


# name -> (restype, argtypes): libggml-base.so.0 (ggml.h, ggml-backend.h)
BASE_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "ggml_get_name": (c_char_p, [c_void_p]),
    "ggml_backend_tensor_get": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
    "ggml_quantize_chunk": (c_size_t, [c_int, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_void_p]),
    "ggml_quantize_requires_imatrix": (c_bool, [c_int]),
    "ggml_get_type_traits": (POINTER(_TypeTraits), [c_int]),
    "ggml_backend_buft_name": (c_char_p, [c_void_p]),
}

# name -> (restype, argtypes): libggml.so.0, the backend registry (ggml-backend.h)
REGISTRY_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "ggml_backend_load": (c_void_p, [c_char_p]),
    "ggml_backend_reg_by_name": (c_void_p, [c_char_p]),
    "ggml_backend_reg_count": (c_size_t, []),
    "ggml_backend_dev_by_name": (c_void_p, [c_char_p]),
    "ggml_backend_dev_type": (c_int, [c_void_p]),
}


def _wheel_lib(name: str) -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib" / name


def _declare(g: ctypes.CDLL, signatures: dict[str, tuple[object, list[object]]]) -> ctypes.CDLL:
    for name, (restype, argtypes) in signatures.items():
        f = getattr(g, name)
        f.restype = restype
        f.argtypes = argtypes
    return g


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """libggml-base.so.0 with BASE_SIGNATURES declared."""
    return _declare(ctypes.CDLL(str(_wheel_lib("libggml-base.so.0"))), BASE_SIGNATURES)


@lru_cache(maxsize=1)
def registry() -> ctypes.CDLL:
    """libggml.so.0, the backend registry llama consults (plugin.py says why this one), with
    REGISTRY_SIGNATURES declared."""
    path = _wheel_lib("libggml.so.0")
    if not path.is_file():
        raise PluginError(f"{path} not found: this llama-cpp-python install has no shared ggml")
    return _declare(ctypes.CDLL(str(path)), REGISTRY_SIGNATURES)


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
