"""libggml-base.so.0 of the installed llama-cpp-python wheel, opened once through ctypes with the few
functions the Python tools call: tensor names and data from graph callbacks, and ggml's quantizer."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path


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
    return g
