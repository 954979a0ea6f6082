"""The plugin's C API (ggml-backend/include/ggml-pi2.h), declared once: its public structs, a table of
function signatures, and the one library handle they are applied to.

The handle is opened once, by lib(). Registration into ggml (plugin.register) passes the same path to
ggml_backend_load, and dlopen hands back the same loaded library, so both see the same state. Every
struct's size is checked against the C side (pi2_struct_size) when the library is opened.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import threading
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path

from ..errors import PluginError

PLUGIN_FILE = "libggml-pi2.so"
MAX_LAYERS = 16384  # PI2_MAX_LAYERS
N_MATRIX = 3       # enum pi2_matrix: gate, up, down
ERR_LEN = 2048     # bytes of the error buffers handed to the C side


class Pi2LayerCounters(ctypes.Structure):
    _fields_ = [
        ("matmul_calls", c_uint64 * N_MATRIX),
        ("matmul_tokens", c_uint64 * N_MATRIX),
        ("rows", c_uint64 * N_MATRIX),
        ("weight_bytes", c_uint64 * N_MATRIX),
        ("glu_calls", c_uint64),
        ("glu_tokens", c_uint64),
        ("sparse_tokens", c_uint64),
        ("neurons", c_uint64),
        ("predicted", c_uint64),
        ("active", c_uint64),
        ("down_sparse_tokens", c_uint64),
        ("checked_tokens", c_uint64),
        ("missed", c_uint64),
        ("hot_hits", c_uint64),
        ("cold_hits", c_uint64),
        ("misses", c_uint64),
        ("bytes_read", c_uint64),
        ("io_requests", c_uint64),
        ("io_wait_ns", c_uint64),
        ("prefetched", c_uint64),
        ("expert_tokens", c_uint64),
        ("experts_routed", c_uint64),
        ("experts_loaded", c_uint64),
        ("expert_neurons", c_uint64),
        ("expert_active", c_uint64),
        ("expert_hits", c_uint64),
        ("expert_misses", c_uint64),
        ("experts_guessed", c_uint64),
        ("experts_guessed_routed", c_uint64),
    ]


class Pi2Counters(ctypes.Structure):
    _fields_ = [
        ("graph_computes", c_uint64),
        ("nodes_computed", c_uint64),
        ("n_layers", c_uint32),
        ("layer", Pi2LayerCounters * MAX_LAYERS),
        ("output_rows", c_uint64),
        ("output_bytes", c_uint64),
    ]


class Pi2CacheInfo(ctypes.Structure):
    _fields_ = [
        ("fixed_bytes", c_uint64),
        ("hot_bytes", c_uint64),
        ("cold_bytes", c_uint64),
        ("hot_neurons", c_uint64),
        ("n_cold", c_uint32),
        ("direct_io", c_uint32),
        ("freq_cutoff", c_float),
        ("n_prefetch", c_uint32),
        ("ffn_ns", c_uint64),
        ("embd_bytes", c_uint64),
        ("io_ring", c_uint32),
        ("n_expert_entries", c_uint32),
        ("expert_bytes", c_uint64),
        ("budget_bytes", c_uint64),
        ("resident_bytes", c_uint64),
        ("reserved_bytes", c_uint64),
        ("tables_bytes", c_uint64),
        ("margin_bytes", c_uint64),
        ("output_copy_bytes", c_uint64),
    ]


class Pi2ModelSummary(ctypes.Structure):
    _fields_ = [
        ("fingerprint", c_uint64),
        ("ffn_bytes", c_uint64),
        ("embedding_bytes", c_uint64),
        ("file_size", c_uint64),
        ("n_tensors", c_int64),
        ("n_layer", c_uint32),
        ("activation", c_int32),
        ("activation_threshold", c_float),
        ("output_bytes", c_uint64),
        ("output_copy_bytes", c_uint64),
        ("experts_native", c_int32),
    ]


class Pi2BudgetFloor(ctypes.Structure):
    _fields_ = [
        ("need", c_uint64),
        ("resident", c_uint64),
        ("non_ffn", c_uint64),
        ("one_layer", c_uint64),
        ("margin", c_uint64),
    ]


# C name -> the mirror above, checked with pi2_struct_size when the library opens
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "pi2_counters": Pi2Counters,
    "pi2_cache_info": Pi2CacheInfo,
    "pi2_model_summary": Pi2ModelSummary,
    "pi2_budget_floor": Pi2BudgetFloor,
}

_ERR: list[object] = [c_char_p, c_size_t]  # char * err, size_t errlen

# name -> (restype, argtypes), in the order of ggml-pi2.h
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "pi2_counters_read": (None, [POINTER(Pi2Counters)]),
    "pi2_counters_reset": (None, []),
    "pi2_build_info": (c_char_p, []),
    "pi2_load_begin": (c_int, [c_char_p, c_char_p, c_int, *_ERR]),
    "pi2_load_end": (None, []),
    "pi2_load_begin_flash": (c_int, [c_char_p, c_char_p, c_int, *_ERR]),
    "pi2_binding_set_budget": (c_int, [c_int, c_uint64, c_uint64, *_ERR]),
    "pi2_binding_cache_info": (c_int, [c_int, POINTER(Pi2CacheInfo)]),
    "pi2_binding_inject_read_fault": (c_int, [c_int, c_int64, c_int]),
    "pi2_config_error": (c_int, _ERR),
    "pi2_binding_set_mode": (c_int, [c_int, c_int]),
    "pi2_binding_set_check_recall": (c_int, [c_int, c_int]),
    "pi2_binding_layers_left": (c_int, [c_int, POINTER(c_int32), c_int]),
    "pi2_binding_error": (c_int, [c_int, *_ERR]),
    "pi2_binding_release": (c_int, [c_int]),
    "pi2_config_set": (c_int, [c_int, c_char_p, c_char_p, *_ERR]),
    "pi2_config_names": (c_int, [c_char_p, c_size_t]),
    "pi2_parse_size": (c_int, [c_char_p, POINTER(c_uint64)]),
    "pi2_resident_bytes": (c_uint64, []),
    "pi2_budget_floor": (c_int, [c_char_p, c_char_p, c_int64, POINTER(Pi2BudgetFloor), *_ERR]),
    "pi2_struct_size": (c_size_t, [c_char_p]),
    "pi2_columns_add": (c_int, [c_int, c_int64, c_void_p, c_int64, c_void_p, c_void_p]),
    "pi2_columns_add_batch": (c_int, [c_int, c_int64, c_int64, c_void_p, c_int64, c_void_p, c_void_p]),
    "pi2_dot_rows_tokens": (c_int, [c_int, c_int64, c_int64, c_void_p, c_int64, c_void_p, c_void_p, c_int]),
    "pi2_time_dense_rows": (c_int, [c_int, c_int64, c_int64, c_int, ctypes.c_double, POINTER(ctypes.c_double)]),
    "pi2_sidecar_validate": (c_int, [c_char_p, *_ERR]),
    "pi2_sidecar_summary": (c_int, [c_char_p, POINTER(c_uint32), POINTER(c_uint64), *_ERR]),
    "pi2_sidecar_sparse_cost": (c_int, [c_char_p, POINTER(ctypes.c_double), c_int, *_ERR]),
    "pi2_dense_whole_layers": (c_int, [c_char_p, c_char_p, c_uint64, POINTER(ctypes.c_uint8), c_int, POINTER(c_uint64),
                                       *_ERR]),
    "pi2_sidecar_check_weight": (c_int, [c_char_p, c_int, c_int, c_int, c_int64, c_int64, c_void_p, c_size_t, *_ERR]),
    "pi2_model_summary": (c_int, [c_char_p, POINTER(Pi2ModelSummary), *_ERR]),
    "pi2_output_copy_make": (c_int, [c_char_p, c_int, POINTER(ctypes.c_int32), POINTER(c_int64), POINTER(c_size_t),
                                     c_void_p, c_size_t, *_ERR]),
    "pi2_fingerprint_tensor": (c_uint64, [c_int, c_int64, c_int64, c_void_p, c_size_t]),
    "pi2_fingerprint_model": (c_uint64, [POINTER(c_uint64), c_size_t]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def plugin_path() -> Path:
    """PI2_PLUGIN if set; else the plugin inside this package; else the one of the installed pi2-gguf
    distribution (when this package is imported from a source checkout)."""
    env = os.environ.get("PI2_PLUGIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise PluginError(f"PI2_PLUGIN={env} is not a file")
        return p
    candidates = [Path(__file__).resolve().parent.parent / "lib" / PLUGIN_FILE]
    try:
        dist = importlib.metadata.distribution("pi2-gguf")
        candidates.append(Path(str(dist.locate_file(f"pi2_gguf/lib/{PLUGIN_FILE}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    for p in candidates:
        if p.is_file():
            return p
    raise PluginError(f"PI2 plugin {PLUGIN_FILE} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
                      "build it with tools/bootstrap.py")


def _open(path: Path) -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  loads the libggml-base.so.0 the plugin links to by soname

    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise PluginError(f"PI2 plugin {path} has no {name}: it is older than this pi2_gguf; rebuild it with "
                              "tools/bootstrap.py") from e
        fn.restype = restype
        fn.argtypes = argtypes
    for cname, mirror in STRUCTS.items():
        c_size, py_size = lib.pi2_struct_size(cname.encode()), ctypes.sizeof(mirror)
        if c_size != py_size:
            raise PluginError(f"PI2 plugin {path}: struct {cname} is {c_size} bytes there and {py_size} in this "
                              "pi2_gguf; rebuild the plugin with tools/bootstrap.py")
    return lib


def lib() -> ctypes.CDLL:
    """The plugin library, opened once with every signature applied and the struct sizes checked."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _open(plugin_path())
        return _lib


def err_buffer() -> ctypes.Array[ctypes.c_char]:
    """A buffer for the C side's error message (pass it with ERR_LEN)."""
    return ctypes.create_string_buffer(ERR_LEN)


def err_text(buf: ctypes.Array[ctypes.c_char]) -> str:
    return buf.value.decode("utf-8", "replace")
